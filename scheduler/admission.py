"""Memory admission: the one owner of the memory budget, decided at start-up and counted once.

It knows the engine's own allocations (weights and the device KV pool, from the engine's own figures,
not from a RAM sample that would count them again), the configured cap of the host tier, a floor left to
the rest of the machine, and the machine's real limit: the container's (cgroup v2 `memory.max`, v1
`memory.limit_in_bytes`, read from the files: psutil does not know cgroups) or else what the OS says is
available (psutil: MemAvailable on Linux, the same figure on Windows and macOS). A host tier that cannot fit
is clamped to what fits, with a warning naming the flag and the value; a machine that cannot even hold the
engine plus the floor is refused with a ValueError that says what to change. The result is the host tier's
budget; `create_admission` hands it to the MemoryAdmission (memory_admission.py) that commits it as
parks need it (or all at start, when the operator asks), re-reading the machine's room at each growth.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

from scheduler.memory_admission import SEGMENT_BYTES, MemoryAdmission

log = logging.getLogger("strata.admission")
MIB = 2**20
_NO_LIMIT = 2**60  # cgroup v1 reports "no limit" as a huge number


@dataclass(frozen=True)
class MachineMemory:
    limit_bytes: int  # total the process tree may use (container limit, or total RAM)
    in_use_bytes: int  # already used by everything else in that scope, excluding this process
    source: str

    @property
    def headroom_bytes(self) -> int:
        return self.limit_bytes - self.in_use_bytes


@dataclass(frozen=True)
class MemoryPlan:
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
