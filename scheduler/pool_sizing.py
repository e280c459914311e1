"""How many KV blocks the device pool reserves and starts with: `--kv-cache-mib N | MIN:MAX | auto`.

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
                     CUDA_MARGIN (scratch buffers); MIN:MAX is elastic there too (engine/backends/cuda_kv_elastic.py)

Every pool holds at least one slot's --ctx-size (a request must fit). Raises ValueError saying what to
change when nothing sensible fits.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from scheduler.admission import MachineMemory, read_machine_memory

MIB = 2**20
AUTO_SHARE = 0.5  # numpy auto: the pool may grow into this share of the room; the host tier keeps the rest
CUDA_MARGIN = 0.1  # cuda auto: share of the arena's free piece left for scratch buffers (at least 256 MiB)


@dataclass(frozen=True)
class PoolSize:
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
    if backend.name == "numpy":
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
    arena = getattr(getattr(backend, "device", None), "arena", None)
    if arena is None:
        raise ValueError(f"--kv-cache-mib auto cannot read the free memory of the {backend.name} backend; "
                         "give --kv-cache-mib N")
    free = arena.largest_free
    usable = free - max(256 * MIB, int(free * CUDA_MARGIN))
    blocks = usable // bytes_per_block
    if blocks < slot_blocks:
        raise ValueError(f"--kv-cache-mib auto: the device has {free // MIB} MiB free after the weights, not "
                         f"enough for one slot's --ctx-size; lower --ctx-size")
    return PoolSize(blocks, None, f"auto: the device arena's {free // MIB} MiB free piece less "
                                  f"{(free - usable) // MIB} MiB for scratch")
