"""The expert cache of the CUDA backend (`--expert-cache-mib N|auto`): MoE expert weights live in a pinned host
arena, and only the hot ones in device slots, copied in on the copy stream before a layer's kernels need them.

Not the conversation (prompt) cache: its metrics and log lines are all named `expert_cache_*` / "expert cache
(MoE weights)", so a high expert hit rate is never read as prompt reuse.

    host (pinned, cuMemHostAlloc):  layer L: [gate E x F rows | up E x F rows | down E x d rows]  as in the GGUF
    device: num_slots slots of slot_bytes, slot s = [gate_e | up_e | down_e] of one (layer, expert)
    per layer and round: a slot table uint64 [3, E] (gate, up, down address of each resident expert, 0 if absent)
                         which moe_matvec_<q> / moe_gemm_<q> read as `expert_ptr` (no change of layout)

One MoE layer of a step (cuda.moe.expert_ffn): the routing ids are read back (a host sync: the step's needed
experts are known only after routing), `ExpertSlots.plan` assigns slots (LRU over all layers, hits and misses
counted per layer), then per round the misses are copied host -> slot on the copy stream after the compute
stream's queued work (so a slot still read by earlier kernels is not overwritten) and the compute stream waits
for them; the round's kernels follow. A layer needing more experts than there are slots runs in rounds.
Decode steps with an expert cache are not captured in CUDA graphs (the read-back is a host round trip).

Budget: a server sizes the slots at start through the memory admission and resizes them as the KV pool needs
room or gives it back (cuda/expert_cache/budget.py; where the slots live: cuda/expert_cache/memory.py);
`request_resize(num_slots)` takes effect at the next step start (`at_step_start`), never mid-step; a shrink
evicts the least recently used and moves the rest down. Pipeline stages share the cache: one MoE layer at a
time plans and queues (a lease from `begin` to `finish`), and a load into a slot another stage read
last waits (on the copy stream) for that stage's fence event. Per-layer counts are keyed by MoE layer ordinal
(the order the layers were loaded in).
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np

from cuda_kernels.moe import plan_groups
from engine.backends.cuda import device as cuda_device
from engine.backends.cuda.arena import round_up
from engine.backends.cuda.device import PinnedBuffer, check
from engine.backends.cuda.expert_cache.layout import ROLES, SLOT_ALIGN, CacheRound, ExpertLayer, round_ranges
from engine.backends.cuda.expert_cache.memory import ArenaSlotMemory
from engine.backends.cuda.expert_cache.slots import ExpertSlots
from engine.backends.cuda.expert_cache.stats import HitRateLog, cache_stats
from engine.units import MIB

log = logging.getLogger("strata.expert_cache")
AUTO_HEADROOM_BYTES = 512 * MIB  # `auto` leaves this much of the arena for activations and graphs


class ExpertCache:
    """Expert weights in pinned host memory, hot ones in device slots (see the module docstring)."""

    def __init__(self, device, budget_mib):
        self.device = device
        self.budget_mib = budget_mib  # int MiB or "auto"; the slot count is fixed at the first step
        self.layers: list[ExpertLayer] = []
        self.slots: ExpertSlots | None = None
        self.memory = None  # memory.ArenaSlotMemory / VmmSlotMemory, from the first size
        self.on_resized = None  # called with the slot count after a resize applied (the budget's hook)
        self.budget = None  # budget.ExpertBudget, when a server's admission sizes the slots
        self.num_grows = self.num_shrinks = self.evicted_by_shrinks = self.moved_by_shrinks = 0
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
        self.hit_log = HitRateLog()

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
        """At the first step without a budget (tools, tests): the slot count from --expert-cache-mib, the
        slots pieces of the arena. A server makes them at start instead (`create_slots`)."""
        if self._pending_slots is not None:  # asked for before the first step (a test)
            wanted, self._pending_slots = self._pending_slots, None
        else:
            wanted = self.wanted_slots(self.device.arena.largest_free - AUTO_HEADROOM_BYTES)
        self.create_slots(wanted, ArenaSlotMemory(self.device, self.slot_bytes))

    def wanted_slots(self, auto_room_bytes: int) -> int:
        """Slots --expert-cache-mib asks for (auto: what auto_room_bytes holds), at most every expert."""
        if self.budget_mib == "auto":
            return min(self.total_experts, max(1, auto_room_bytes // self.slot_bytes))
        wanted = min(self.total_experts, int(self.budget_mib * MIB) // self.slot_bytes)
        if wanted < 1:
            raise ValueError(f"--expert-cache-mib {self.budget_mib} is smaller than one expert slot "
                             f"({self.slot_bytes / MIB:.2f} MiB: gate, up and down of one expert)")
        return wanted

    def create_slots(self, num_slots: int, memory) -> None:
        """The device slots, once, every layer registered: num_slots of them in `memory`
        (cuda/expert_cache/memory.py). Before the first step; later sizes go through request_resize."""
        assert self.slots is None, "the expert cache's slots exist already"
        self.memory = memory
        self.slots = ExpertSlots(0)
        self._resize(min(self.total_experts, num_slots))
        self.num_grows = 0  # the first size is no resize
        log.info("expert cache (MoE weights, not the prompt cache): %d device slots of %.2f MiB (%s) for %d "
                 "experts (%d layers), host arena %.0f MiB pinned", self.slots.num_slots, self.slot_bytes / MIB,
                 memory.kind, self.total_experts, len(self.layers), self.host_arena_bytes / MIB)

    # -- budget (cuda/expert_cache/budget.py drives these through the memory admission) --------------------
    @property
    def num_slots(self) -> int:
        return 0 if self.slots is None else self.slots.num_slots

    @property
    def device_bytes(self) -> int:
        """What the slots take of the device budget now (vmm: whole chunks)."""
        return self.memory.bytes_for(self.num_slots) if self.memory is not None else 0

    @property
    def pending_slots(self) -> int | None:
        with self._lock:
            return self._pending_slots

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
        """Apply a pending resize (called by the backend between steps; waits for another stage's layer),
        then tell `on_resized` (the budget: it gives freed bytes back to the memory admission)."""
        if self._pending_slots is None or self.slots is None:
            return
        with self._lease, self._lock:
            wanted, self._pending_slots = self._pending_slots, None
            if wanted is None:
                return
            for backend in self._users:  # kernels of an earlier step may still read a slot about to go
                backend.synchronize_stream(backend.stream)
            self._slot_user.clear()
            self._resize(min(self.total_experts, wanted))
            num_slots = self.slots.num_slots
        if self.on_resized is not None:
            self.on_resized(num_slots)

    def _resize(self, wanted: int) -> None:
        """Grow (as far as the memory allows) or shrink to `wanted` slots; the streams are idle."""
        before = self.slots.num_slots
        if wanted > before:
            self.slots.resize(self.memory.resize(wanted))
            self.num_grows += self.slots.num_slots > before
        elif wanted < before:
            _, _, evicted, moves = self.slots.resize(wanted)
            for layer, expert in evicted:
                self.layers[layer].table[:, expert] = 0
            self._move_down(moves)
            self.memory.resize(wanted)
            self.num_shrinks += 1
            self.evicted_by_shrinks += len(evicted)

    def _move_down(self, moves) -> None:
        """Copy each moved expert's slot into its new, lower slot (before the memory above goes)."""
        if not moves:
            return
        backend = next(iter(self._users))  # residents exist, so some stage planned a layer
        for (layer_index, expert), old, new in moves:
            layer = self.layers[layer_index]
            self.device.dtod(self.memory.address(new), self.memory.address(old), layer.slot_bytes, backend.stream)
            base = self.memory.address(new)
            layer.table[:, expert] = [base + layer.slot_offsets[role] for role in ROLES]
        backend.synchronize_stream(backend.stream)
        self.moved_by_shrinks += len(moves)

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
        self.hit_log.maybe_log(self)
        plan = plan_groups(ids_host, group_rows)
        return [round_ranges(r, plan) for r in rounds]

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
                base = self.memory.address(slot)
                layer.table[:, expert] = [base + layer.slot_offsets[role] for role in ROLES]
        with backend.on_copy_stream():
            for other in {self._slot_user.get(slot) for _, slot in r.loads} - {None, backend}:
                # another stage's kernels read these slots last: its stream, not ours, orders them
                check(cuda_device.driver.cuStreamWaitEvent(backend.copy_stream, self._fence[other], 0),
                      "cuStreamWaitEvent")
            for expert, slot in r.loads:
                base = self.memory.address(slot)
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
            return cache_stats(self)
