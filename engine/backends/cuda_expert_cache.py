"""The expert cache of the CUDA backend (`--expert-cache-mib N|auto`): MoE expert weights live in a pinned host
arena, and only the hot ones in device slots, copied in on the copy stream before a layer's kernels need them.

Not the conversation (prompt) cache: its metrics and log lines are all named `expert_cache_*` / "expert cache
(MoE weights)", so a high expert hit rate is never read as prompt reuse.

    host (pinned, cuMemHostAlloc):  layer L: [gate E x F rows | up E x F rows | down E x d rows]  as in the GGUF
    device: num_slots slots of slot_bytes, slot s = [gate_e | up_e | down_e] of one (layer, expert)
    per layer and round: a slot table uint64 [3, E] (gate, up, down address of each resident expert, 0 if absent)
                         which moe_matvec_<q> / moe_gemm_<q> read as `expert_ptr` (no change of layout)

One MoE layer of a step (cuda_moe.expert_ffn): the routing ids are read back (a host sync: the step's needed
experts are known only after routing), `ExpertSlots.plan` assigns slots (LRU over all layers, hits and misses
counted per layer), then per round the misses are copied host -> slot on the copy stream after the compute
stream's queued work (so a slot still read by earlier kernels is not overwritten) and the compute stream waits
for them; the round's kernels follow. A layer needing more experts than there are slots runs in rounds.
Decode steps with an expert cache are not captured in CUDA graphs (the read-back is a host round trip).

Budget: `request_resize(num_slots)` (the memory admission's hook, scheduler/memory_admission.register_budget)
takes effect at the next step start (`at_step_start`), never mid-step. Pipeline stages share the cache: one MoE
layer at a time plans and queues (a lease from `begin` to `finish`), and a load into a slot another stage read
last waits (on the copy stream) for that stage's fence event. Per-layer counts are keyed by MoE layer ordinal
(the order the layers were loaded in).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from cuda_kernels.moe import plan_groups
from engine.backends import cuda_device
from engine.backends.cuda_arena import round_up
from engine.backends.cuda_device import PinnedBuffer, check
from engine.backends.cuda_expert_cache_slots import ExpertSlots

log = logging.getLogger("strata.expert_cache")
MIB = 2**20
ROLES = ("gate", "up", "down")
SLOT_ALIGN = 256  # each matrix of a slot starts aligned, whatever its rows' byte length
AUTO_HEADROOM_BYTES = 512 * MIB  # `auto` leaves this much of the arena for activations and graphs
LOG_INTERVAL_S = 30.0


@dataclass
class ExpertLayer:
    """One MoE layer's experts in the host arena: role -> (offset of expert 0, bytes per expert)."""

    index: int
    n_experts: int
    host: PinnedBuffer
    parts: dict  # role -> (host offset, expert bytes)
    slot_offsets: dict  # role -> offset inside a slot
    table: np.ndarray  # uint64 [3, E] host mirror of the slot addresses

    @property
    def slot_bytes(self) -> int:
        return self.slot_offsets["down"] + self.parts["down"][1]


@dataclass(frozen=True)
class CacheRound:
    """A round of one layer's step: its groups [g0, g1) and pairs [p0, p1) of the sorted pair plan."""

    experts: tuple
    loads: tuple  # (expert, slot)
    evicted: tuple  # (layer, expert) keys the loads displace
    g0: int
    g1: int
    p0: int
    p1: int
    slots: tuple = ()  # every slot the round reads


class ExpertCache:
    """Expert weights in pinned host memory, hot ones in device slots (see the module docstring)."""

    def __init__(self, device, budget_mib):
        self.device = device
        self.budget_mib = budget_mib  # int MiB or "auto"; the slot count is fixed at the first step
        self.layers: list[ExpertLayer] = []
        self.slots: ExpertSlots | None = None
        self._slot_address: dict[int, int] = {}
        self._pending_slots: int | None = None
        self._lock = threading.Lock()  # the bookkeeping: pipeline stages on one device share the cache
        # One MoE layer at a time plans and queues (begin .. finish): pipeline stages run on their own threads,
        # and one's eviction must not pick a slot another has planned but not yet queued kernels for.
        self._lease = threading.Lock()
        self._users: set = set()  # backends that launched kernels reading slots (synchronised before a shrink)
        self._fence: dict = {}  # backend -> event recorded after its latest cached layer's kernels
        self._slot_user: dict[int, object] = {}  # slot -> the backend whose kernels read it last
        self._timing: dict = {}  # backend -> [(start, end)] events of its compute stream's waits for copies
        self._free_events: list = []
        self.loads = self.loaded_bytes = 0
        self.wait_seconds = self.routing_sync_seconds = 0.0
        self._last_log = (time.monotonic(), 0, 0)

    # -- load time --------------------------------------------------------------------------------------
    def register(self, parts: dict, n_experts: int) -> ExpertLayer:
        """A layer's stacked expert rows (role -> uint8 [E * rows, row_bytes]) into the pinned arena."""
        self.device.ensure_current()
        sizes = {role: parts[role].nbytes // n_experts for role in ROLES}
        host = PinnedBuffer(sum(parts[role].nbytes for role in ROLES))
        layout, offset = {}, 0
        for role in ROLES:
            host.array[offset : offset + parts[role].nbytes] = np.ascontiguousarray(parts[role]).reshape(-1)
            layout[role] = (offset, sizes[role])
            offset += parts[role].nbytes
        slot_offsets = {"gate": 0, "up": round_up(sizes["gate"], SLOT_ALIGN)}
        slot_offsets["down"] = slot_offsets["up"] + round_up(sizes["up"], SLOT_ALIGN)
        layer = ExpertLayer(len(self.layers), n_experts, host, layout, slot_offsets,
                            np.zeros((3, n_experts), dtype=np.uint64))
        self.layers.append(layer)
        return layer

    @property
    def host_arena_bytes(self) -> int:
        return sum(layer.host.nbytes for layer in self.layers)

    @property
    def slot_bytes(self) -> int:
        return round_up(max(layer.slot_bytes for layer in self.layers), SLOT_ALIGN)

    @property
    def total_experts(self) -> int:
        return sum(layer.n_experts for layer in self.layers)

    def _create_slots(self) -> None:
        """At the first step (every layer registered): the slot count from the budget, the slots reserved."""
        slot_bytes = self.slot_bytes
        if self._pending_slots is not None:  # asked for before the first step (the admission, or a test)
            wanted, self._pending_slots = min(self.total_experts, self._pending_slots), None
        elif self.budget_mib == "auto":
            room = self.device.arena.largest_free - AUTO_HEADROOM_BYTES
            wanted = min(self.total_experts, max(1, room // slot_bytes))
        else:
            wanted = min(self.total_experts, int(self.budget_mib * MIB) // slot_bytes)
            if wanted < 1:
                raise ValueError(f"--expert-cache-mib {self.budget_mib} is smaller than one expert slot "
                                 f"({slot_bytes / MIB:.2f} MiB: gate, up and down of one expert)")
        self.slots = ExpertSlots(0)
        self._resize(wanted)
        log.info("expert cache (MoE weights, not the prompt cache): %d device slots of %.2f MiB for %d experts "
                 "(%d layers), host arena %.0f MiB pinned", self.slots.num_slots, slot_bytes / MIB,
                 self.total_experts, len(self.layers), self.host_arena_bytes / MIB)

    # -- budget (the admission's hook) --------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return 0 if self.slots is None else self.slots.num_slots

    @property
    def device_bytes(self) -> int:
        return self.num_slots * self.slot_bytes if self.layers else 0

    def request_resize(self, num_slots: int) -> None:
        """Ask for num_slots slots (>= 1); applied at the next step start, never while a step runs."""
        assert num_slots >= 1, "the expert cache needs at least one slot"
        with self._lock:
            self._pending_slots = num_slots

    def request_grow(self, n_slots: int) -> None:
        """n_slots more than the current (or already requested) count, from the next step start."""
        with self._lock:
            base = self._pending_slots if self._pending_slots is not None else self.num_slots
            self._pending_slots = base + n_slots

    def request_shrink(self, n_slots: int) -> None:
        """n_slots fewer (at least one left), from the next step start; evicts the least recently used."""
        with self._lock:
            base = self._pending_slots if self._pending_slots is not None else self.num_slots
            self._pending_slots = max(1, base - n_slots)

    def at_step_start(self) -> None:
        """Apply a pending resize (called by the backend between steps; waits for another stage's layer)."""
        if self._pending_slots is None or self.slots is None:
            return
        with self._lease, self._lock:
            wanted, self._pending_slots = self._pending_slots, None
            if wanted is None:
                return
            for backend in self._users:  # kernels of an earlier step may still read a slot about to go
                backend.synchronize_stream(backend.stream)
            self._slot_user.clear()
            self._resize(wanted)

    def _resize(self, wanted: int) -> None:
        slot_bytes = self.slot_bytes
        while self.slots.num_slots < wanted:  # one slot at a time: stop where the arena is full
            address = self.device.reserve(slot_bytes)
            if address is None:
                if self.slots.num_slots == 0:
                    raise MemoryError(f"no GPU memory for one expert slot ({slot_bytes / MIB:.2f} MiB)")
                log.warning("expert cache: the arena is full at %d of %d slots", self.slots.num_slots, wanted)
                break
            (slot,), _, _ = self.slots.resize(self.slots.num_slots + 1)
            self._slot_address[slot] = address
        if self.slots.num_slots > wanted:
            _, removed, evicted = self.slots.resize(wanted)
            for layer, expert in evicted:
                self.layers[layer].table[:, expert] = 0
            for slot in removed:
                self.device.unreserve(self._slot_address.pop(slot))

    # -- one layer of a step --------------------------------------------------------------------------------
    def begin(self, backend, layer: ExpertLayer, ids, group_rows: int) -> list[CacheRound]:
        """Read the step's routing back and plan its rounds (slots assigned, hits and misses counted)."""
        started = time.perf_counter()
        ids_host = np.empty(ids.shape, dtype=np.int32)
        self.device.dtoh(ids_host.ctypes.data, ids.ptr, ids_host.nbytes, backend.stream)
        backend.synchronize_stream(backend.stream)
        self.routing_sync_seconds += time.perf_counter() - started
        self._read_timings(backend)  # its stream is idle now
        self._lease.acquire()  # released by finish()
        try:
            with self._lock:
                if self.slots is None:
                    self._create_slots()
                self._users.add(backend)
                rounds = self.slots.plan(layer.index, np.unique(ids_host))
        except BaseException:
            self._lease.release()
            raise
        self._maybe_log()
        plan = plan_groups(ids_host, group_rows)
        return [self._ranges(r, plan) for r in rounds]

    @staticmethod
    def _ranges(r, plan) -> CacheRound:
        group_expert = plan["group_expert"]
        g0 = int(np.searchsorted(group_expert, r.experts[0], "left"))
        g1 = int(np.searchsorted(group_expert, r.experts[-1], "right"))
        p0 = int(plan["group_start"][g0])
        p1 = int(plan["group_start"][g1 - 1] + plan["group_len"][g1 - 1])
        return CacheRound(r.experts, r.loads, r.evicted, g0, g1, p0, p1, r.slots)

    def load(self, backend, layer: ExpertLayer, r: CacheRound):
        """Queue the round's copies on the copy stream (the compute stream waits for them). Returns (role ->
        device address of this round's slot table row, for `expert_ptr`; the table's DeviceArray, which the
        caller keeps until the round's kernels are queued)."""
        start, end = (self._free_events.pop() if self._free_events else self.device.create_event(timing=True)
                      for _ in range(2))
        check(cuda_device.driver.cuEventRecord(start, backend.stream), "cuEventRecord")
        with self._lock:  # the tables change here, round by round: a later round may reuse this one's slots
            for key in r.evicted:
                self.layers[key[0]].table[:, key[1]] = 0
            for expert, slot in r.loads:
                base = self._slot_address[slot]
                layer.table[:, expert] = [base + layer.slot_offsets[role] for role in ROLES]
        with backend.on_copy_stream():
            for other in {self._slot_user.get(slot) for _, slot in r.loads} - {None, backend}:
                # another stage's kernels read these slots last: its stream, not ours, orders them
                check(cuda_device.driver.cuStreamWaitEvent(backend.copy_stream, self._fence[other], 0),
                      "cuStreamWaitEvent")
            for expert, slot in r.loads:
                base = self._slot_address[slot]
                for role in ROLES:
                    host_offset, nbytes = layer.parts[role]
                    self.device.htod(base + layer.slot_offsets[role], layer.host.ptr + host_offset + expert * nbytes,
                                     nbytes, backend.copy_stream)
                    self.loaded_bytes += nbytes
            self.loads += len(r.loads)
            table = backend.upload_activation(layer.table)  # this round's table: a later round may change it
        check(cuda_device.driver.cuEventRecord(end, backend.stream), "cuEventRecord")
        with self._lock:
            self._timing.setdefault(backend, []).append((start, end))
        return {role: table.ptr + i * 8 * layer.n_experts for i, role in enumerate(ROLES)}, table

    def finish(self, backend, rounds) -> None:
        """The layer's kernels are queued: fence its slots with an event on backend's stream (a later load by
        another stage waits for it) and let the next layer plan."""
        try:
            with self._lock:
                if backend not in self._fence:
                    self._fence[backend] = self.device.create_event()
                check(cuda_device.driver.cuEventRecord(self._fence[backend], backend.stream), "cuEventRecord")
                for r in rounds:
                    self._slot_user.update({slot: backend for slot in r.slots})
        finally:
            self._lease.release()

    def _read_timings(self, backend) -> None:
        """Add up backend's compute-stream waits for copies (complete: the caller has just synchronised)."""
        with self._lock:
            pairs = self._timing.pop(backend, [])
            for start, end in pairs:
                ms = check(cuda_device.driver.cuEventElapsedTime(start, end), "cuEventElapsedTime")
                self.wait_seconds += float(ms) / 1e3
                self._free_events += [start, end]

    # -- metrics ----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """expert_cache_* figures for /metrics and the log (counters since start; per layer hits/misses)."""
        with self._lock:  # /metrics reads on the loop thread while a stage's worker plans
            return self._stats()

    def _stats(self) -> dict:
        counts = {} if self.slots is None else self.slots.counts
        hits = sum(c.hits for c in counts.values())
        misses = sum(c.misses for c in counts.values())
        return {
            "expert_cache_slots": self.num_slots,
            "expert_cache_slots_used": len(self.slots.resident()) if self.slots else 0,
            "expert_cache_slot_bytes": self.slot_bytes if self.layers else 0,
            "expert_cache_device_bytes": self.device_bytes, "expert_cache_host_bytes": self.host_arena_bytes,
            "expert_cache_hits": hits, "expert_cache_misses": misses,
            "expert_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "expert_cache_loads": self.loads, "expert_cache_loaded_bytes": self.loaded_bytes,
            "expert_cache_wait_seconds": self.wait_seconds,
            "expert_cache_routing_sync_seconds": self.routing_sync_seconds,
            "expert_cache_layers": {layer: (c.hits, c.misses) for layer, c in sorted(counts.items())},
        }

    def _maybe_log(self) -> None:
        now = time.monotonic()
        last_time, last_hits, last_misses = self._last_log
        if now - last_time < LOG_INTERVAL_S:
            return
        s = self.stats()
        hits, misses = s["expert_cache_hits"] - last_hits, s["expert_cache_misses"] - last_misses
        self._last_log = (now, s["expert_cache_hits"], s["expert_cache_misses"])
        if hits + misses:
            log.info("expert cache (MoE weights, not the prompt cache): %.0f%% of %d expert uses found on the "
                     "device in the last %.0f s; %d loads, %.0f MiB moved, %.2f s waited in all",
                     100.0 * hits / (hits + misses), hits + misses, now - last_time, s["expert_cache_loads"],
                     s["expert_cache_loaded_bytes"] / MIB, s["expert_cache_wait_seconds"], extra={"fields": {
                         k: v for k, v in s.items() if k != "expert_cache_layers"}})
