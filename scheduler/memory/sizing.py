"""Start-up sizing of the memory tiers: the machine's limit, the host tier's budget, the device KV pool.

Sizing decides once, at start, from the engine's own figures (weights and the device KV pool, counted once,
not again from a RAM sample) and the machine's real limit: the container's (cgroup v2 `memory.max`, v1
`memory.limit_in_bytes`, read from the files: psutil does not know cgroups) or else what the OS says is
available (psutil: MemAvailable on Linux, the same figure on Windows and macOS). It owns no running state:
`create_admission` hands the host budget to the MemoryAdmission (memory/admission.py), the one owner of the
budgets while the server runs, which commits it as parks need it (or all at start, when the operator asks),
re-reading the machine's room at each growth.

    host tier  `plan_memory`: --conversation-cache-mib, clamped to what fits (a warning names the flag and
               the value); a machine that cannot hold the engine plus the floor is refused with a ValueError
               that says what to change
    KV pool    `size_kv_pool`: `--kv-cache-mib N | MIN:MAX | auto`

        N         a fixed pool of N MiB (0: --batch * --ctx-size tokens, as before)
        MIN:MAX   an elastic pool (numpy): it starts at MIN MiB (0: --batch * --ctx-size) and grows up to
                  MAX MiB as requests need room; it shrinks when the memory admission asks
                  (`--kv-cache-mib MIN --kv-cache-max-mib MAX` is the older spelling of the same)
        auto      sized from what the machine has, counting the engine once (its own figure, not a sample):
                  numpy  room = headroom - weights - --conversation-cache-min-free-mib, where headroom is the
                         container limit (cgroup memory.max) or MemAvailable, less what others use there;
                         an elastic pool from --batch * --ctx-size up to AUTO_SHARE of the room (the rest is
                         the host tier's to take as parks need it, and it is clamped to what is left)
                  cuda   a fixed pool of the device arena's largest free piece after the weights, less
                         CUDA_MARGIN (scratch buffers); MIN:MAX is elastic there too
                         (engine/backends/cuda/kv_elastic.py)

    Every pool holds at least one slot's --ctx-size (a request must fit).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.units import MIB
from scheduler.memory.admission import SEGMENT_BYTES, MemoryAdmission

log = logging.getLogger("strata.admission")
_NO_LIMIT = 2**60  # cgroup v1 reports "no limit" as a huge number
AUTO_SHARE = 0.5  # numpy auto: the pool may grow into this share of the room; the host tier keeps the rest
CUDA_MARGIN = 0.1  # cuda auto: share of the arena's free piece left for scratch buffers (at least 256 MiB)


@dataclass(frozen=True)
class MachineMemory:
    """The memory limit that applies to this process and what others already use of it, sampled once."""

    limit_bytes: int  # total the process tree may use (container limit, or total RAM)
    in_use_bytes: int  # already used by everything else in that scope, excluding this process
    source: str

    @property
    def headroom_bytes(self) -> int:
        return self.limit_bytes - self.in_use_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The start-up plan: the engine's own host bytes and the host tier's budget (clamped_from_mib: the
    --conversation-cache-mib asked for, when it did not fit)."""

    engine_bytes: int
    host_tier_bytes: int
    host_blocks: int
    machine: MachineMemory
    clamped_from_mib: int | None = None


def read_machine_memory(root: Path = Path("/")) -> MachineMemory:
    """The limit that applies to this process: cgroup v2, then v1 (Linux), then the OS's total and available
    memory (psutil, any OS)."""
    own = _own_rss_bytes()
    v2 = root / "sys/fs/cgroup/memory.max"
    if v2.exists() and v2.read_text().strip() not in ("", "max"):
        current = int((root / "sys/fs/cgroup/memory.current").read_text())
        return MachineMemory(int(v2.read_text()), max(0, current - own), "cgroup v2 memory.max")
    v1 = root / "sys/fs/cgroup/memory/memory.limit_in_bytes"
    if v1.exists() and int(v1.read_text()) < _NO_LIMIT:
        usage = int((root / "sys/fs/cgroup/memory/memory.usage_in_bytes").read_text())
        return MachineMemory(int(v1.read_text()), max(0, usage - own), "cgroup v1 memory.limit_in_bytes")
    memory = psutil.virtual_memory()
    # Available memory already excludes this process's own pages: add them back so they are counted once,
    # as the engine's figure, and not a second time as "used by others".
    return MachineMemory(memory.total, max(0, memory.total - memory.available - own), "available memory")


def plan_memory(engine_bytes: int, host_tier_mib: int, min_free_mib: int, block_bytes: int,
                machine: MachineMemory | None = None) -> MemoryPlan:
    """Size the host tier of the conversation cache. Raises ValueError when nothing sensible fits."""
    machine = machine or read_machine_memory()
    spare = machine.headroom_bytes - engine_bytes - min_free_mib * MIB
    if spare < 0:
        raise ValueError(
            f"the engine needs {engine_bytes // MIB} MiB (weights + KV pool) and "
            f"--conversation-cache-min-free-mib keeps {min_free_mib} MiB free, but only "
            f"{machine.headroom_bytes // MIB} MiB are available ({machine.source}); lower --kv-cache-mib, "
            f"--batch or --ctx-size, or lower --conversation-cache-min-free-mib")
    wanted = host_tier_mib * MIB
    granted, clamped = wanted, None
    if wanted > spare:
        granted, clamped = spare, host_tier_mib
        log.warning(
            "--conversation-cache-mib %d does not fit: %d MiB available (%s) - %d MiB engine - %d MiB floor "
            "(--conversation-cache-min-free-mib) leaves %d MiB; using --conversation-cache-mib %d",
            host_tier_mib, machine.headroom_bytes // MIB, machine.source, engine_bytes // MIB, min_free_mib,
            spare // MIB, spare // MIB)
    blocks = int(granted // block_bytes) if block_bytes else 0  # whole blocks of a fractional MiB (benchmarks)
    return MemoryPlan(engine_bytes, blocks * block_bytes, blocks, machine, clamped)


def create_admission(plan: MemoryPlan, commit_at_start: bool, min_free_mib: int) -> MemoryAdmission:
    """The running admission for a start-up plan: host budget from the plan, committed now or on demand."""
    block_bytes = plan.host_tier_bytes // plan.host_blocks if plan.host_blocks else 1

    def machine_room_bytes() -> int:  # engine counted once, from its own figure; others from the live sample
        return read_machine_memory().headroom_bytes - plan.engine_bytes - min_free_mib * MIB

    return MemoryAdmission(plan.host_blocks, block_bytes,
                           host_committed_blocks=plan.host_blocks if commit_at_start else 0,
                           segment_blocks=max(1, SEGMENT_BYTES // block_bytes), machine_room_bytes=machine_room_bytes)


def _own_rss_bytes() -> int:
    """This process's resident bytes now (psutil: /proc/self/statm on Linux, the working set on Windows)."""
    return psutil.Process().memory_info().rss


@dataclass(frozen=True)
class PoolSize:
    """The device KV pool as sized from --kv-cache-mib: its ids, its starting size, and why."""

    reserved_blocks: int  # ids the runner reserves (an elastic pool's maximum)
    min_blocks: int | None  # an elastic pool's starting size; None: a fixed pool
    rule: str  # how it was chosen, for the start-up log


def parse_kv_cache_mib(spec: str, max_mib: int = 0) -> tuple[int, int] | None:
    """(MIN, MAX) MiB of `--kv-cache-mib` (MAX 0: a fixed pool), or None for auto. ValueError on a bad one.
    A fractional MiB is taken as it is (scripts/bench_cache.py sizes tiny models' pools in whole blocks)."""
    text = str(spec).strip().lower()
    if text == "auto":
        if max_mib:
            raise ValueError("--kv-cache-mib auto sizes the pool itself; drop --kv-cache-max-mib")
        return None
    low, sep, high = text.partition(":")
    try:
        lo, hi = _mib(low), _mib(high) if sep else max_mib
    except ValueError:
        raise ValueError(f"--kv-cache-mib {spec!r} is not MiB, MIN:MAX or auto (e.g. 2048, 1024:8192)") from None
    if sep and max_mib:
        raise ValueError("give the maximum once: --kv-cache-mib MIN:MAX, or --kv-cache-mib MIN --kv-cache-max-mib MAX")
    if lo < 0 or hi < 0:
        raise ValueError(f"--kv-cache-mib {spec!r}: sizes must be >= 0 MiB")
    if hi and lo and hi < lo:
        raise ValueError(f"--kv-cache-mib {spec!r}: MAX is below MIN")
    return lo, hi


def _mib(text: str) -> int | float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return int(value) if value.is_integer() else value


def size_kv_pool(spec: tuple[int, int] | None, *, bytes_per_block: int, slot_blocks: int, batch: int,
                 backend, weight_bytes: int, min_free_mib: int, machine: MachineMemory | None = None) -> PoolSize:
    """The pool for a parsed --kv-cache-mib (spec None: auto) on this backend and machine."""
    default = slot_blocks * batch
    if spec is not None:
        lo, hi = spec
        start = max(slot_blocks, int(lo * MIB) // bytes_per_block) if lo else default
        if not hi:
            return PoolSize(start, None, f"--kv-cache-mib {lo}" if lo else "--batch * --ctx-size")
        reserved = int(hi * MIB) // bytes_per_block
        if reserved < start:
            raise ValueError(f"--kv-cache-mib MAX {hi} is below the starting pool of {start * bytes_per_block // MIB} "
                             "MiB (MIN, or --batch * --ctx-size)")
        return PoolSize(reserved, start if start < reserved else None, f"--kv-cache-mib {lo}:{hi}")
    if backend.capabilities.on_host:
        return _auto_numpy(bytes_per_block, slot_blocks, default, weight_bytes, min_free_mib,
                           machine or read_machine_memory())
    return _auto_device(backend, bytes_per_block, slot_blocks)


def _auto_numpy(bytes_per_block: int, slot_blocks: int, default: int, weight_bytes: int, min_free_mib: int,
                machine: MachineMemory) -> PoolSize:
    room = machine.headroom_bytes - weight_bytes - min_free_mib * MIB
    reserved = int(room * AUTO_SHARE) // bytes_per_block
    if reserved < slot_blocks:
        raise ValueError(f"--kv-cache-mib auto: {max(0, room) // MIB} MiB of room ({machine.source}: "
                         f"{machine.headroom_bytes // MIB} MiB - weights {weight_bytes // MIB} MiB - "
                         f"--conversation-cache-min-free-mib {min_free_mib}) does not hold one slot's --ctx-size "
                         f"({slot_blocks * bytes_per_block // MIB} MiB); lower --ctx-size or give --kv-cache-mib N")
    start = min(default, reserved)
    rule = (f"auto: {AUTO_SHARE:.0%} of {room // MIB} MiB room ({machine.source} headroom "
            f"{machine.headroom_bytes // MIB} MiB - weights {weight_bytes // MIB} MiB - floor {min_free_mib} MiB)")
    return PoolSize(reserved, start if start < reserved else None, rule)


def _auto_device(backend, bytes_per_block: int, slot_blocks: int) -> PoolSize:
    free = backend.device_free_bytes()  # declared by every backend that is not on_host (engine/backends/base.py)
    if free is None:
        raise ValueError(f"--kv-cache-mib auto cannot read the free memory of the {backend.name} backend; "
                         "give --kv-cache-mib N")
    usable = free - max(256 * MIB, int(free * CUDA_MARGIN))
    blocks = usable // bytes_per_block
    if blocks < slot_blocks:
        raise ValueError(f"--kv-cache-mib auto: the device has {free // MIB} MiB free after the weights, not "
                         f"enough for one slot's --ctx-size; lower --ctx-size")
    return PoolSize(blocks, None, f"auto: the device arena's {free // MIB} MiB free piece less "
                                  f"{(free - usable) // MIB} MiB for scratch")
