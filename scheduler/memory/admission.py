"""Memory admission: the one owner of the memory budgets while the server runs, on the event loop.

Start-up sizing (memory/sizing.py) fixes the host tier's *budget*; this object then decides, each
time the cache wants host RAM it has not used yet, whether to *commit* another segment of it: only while
the budget allows and the machine still has the room (the container limit or MemAvailable, re-read at
that moment, minus the engine's own bytes counted once from its own figures and the floor left to the
rest of the machine). Host RAM is therefore taken as parks need it, not at start, unless the operator
asks for commit-at-start (`--conversation-cache-commit at-start`).

    budget     |=============================================|  what the host tier may ever hold
    committed  |====================|                            segments the runner has allocated
    used       |===========|                                    slots holding parked blocks

The device tier has a budget too: the KV pool's ids (`device_budget_bytes`, the reserve of an elastic
pool) shared with the other budget holders (the MoE expert cache: memory/service.py's `register_budget`,
memory/holders.py). What they hold lowers the pool's ceiling:

    device budget |=============================================|
    KV pool       |==================|          |===============|  held by other budget holders
    ceiling       |==============================|                 min(operator's ceiling, budget - held)

This object decides (grant, room, ceilings); memory/service.py serves the requests for memory
one at a time, in arrival order, and applies what is granted. Mutated only on the event loop; a refusal
leaves everything as it was and the cache then treats the host tier as full (spill to disk, else drop,
logged).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

from engine.units import MIB

log = logging.getLogger("strata.admission")
SEGMENT_BYTES = 64 * MIB  # host RAM committed per growth of the host tier


class MemoryAdmission:
    """Budgets of the host tier (budget / committed / used) and the grants that grow what is committed."""

    def __init__(self, host_budget_blocks: int, block_bytes: int, *, host_committed_blocks: int | None = None,
                 segment_blocks: int | None = None, machine_room_bytes: Callable[[], int] | None = None):
        self.host_budget_blocks = host_budget_blocks
        self.block_bytes = block_bytes
        # Default (tests, tools): everything committed at start, as a fixed-size tier.
        self.host_committed_blocks = host_budget_blocks if host_committed_blocks is None else host_committed_blocks
        assert 0 <= self.host_committed_blocks <= host_budget_blocks, "committed beyond the host budget"
        self.segment_blocks = max(1, segment_blocks or host_budget_blocks or 1)
        # Bytes the machine can give the host tier in all (headroom - engine - floor), read when asked.
        self._machine_room_bytes = machine_room_bytes
        self.refusals = 0
        self.refuse_points: set[str] = set()  # tests: "park", "restore", "spill", "grow", "device_grow"
        # The device pool (scheduler/cache/device_pool.py): fixed unless set_device_pool gives it room to move.
        self.device_reserved_blocks = 0  # ids the runner's pools address (their memory committed as used)
        self.device_min_blocks = 0
        self.device_segment_blocks = 1
        self._operator_ceiling_blocks = 0  # set_device_ceiling (POST /cache/device-pool, the signals)
        self.device_budget_bytes = 0  # the KV pool's ids and the other holders' bytes share this
        self.held_device_bytes: dict[str, int] = {}  # other budget holders (memory/holders.BudgetHolder)

    def add_holder(self, name: str) -> None:
        """A holder of device bytes beside the KV pool (memory/holders.py), holding nothing yet."""
        assert name not in self.held_device_bytes, f"holder {name!r} added twice"
        self.held_device_bytes[name] = 0

    def hold(self, name: str, nbytes: int) -> None:
        """A granted grow: the holder holds nbytes more of the device budget (the pool's ceiling drops)."""
        self.held_device_bytes[name] += nbytes

    def release_held(self, name: str, nbytes: int) -> None:
        """The holder freed nbytes: they return to the device budget (the pool's ceiling rises)."""
        held = self.held_device_bytes[name]
        assert 0 < nbytes <= held, f"{name} gives back {nbytes} bytes of {held} held"
        self.held_device_bytes[name] = held - nbytes

    def count_refusal(self) -> None:
        """A request for memory refused outside grant (a holder's grow): counted with the others."""
        self.refusals += 1

    def add_device_budget(self, nbytes: int) -> None:
        """A fixed pool's device budget is its own bytes; a holder beside it brings its bytes along
        (counted once: the pool never grows into them, the holder never takes the pool's)."""
        assert not self.device_reserved_blocks, "an elastic pool's budget is its reserve, shared with the holders"
        self.device_budget_bytes += nbytes

    @contextlib.contextmanager
    def released_for_planning(self, nbytes_by_holder: dict[str, int]):
        """Plan as if each holder held that many bytes less (what it could give back): a what-if, restored
        on exit; only plans (which change nothing) may run inside."""
        for name, nbytes in nbytes_by_holder.items():
            self.held_device_bytes[name] -= nbytes
        try:
            yield
        finally:
            for name, nbytes in nbytes_by_holder.items():
                self.held_device_bytes[name] += nbytes

    def set_device_pool(self, min_blocks: int, reserved_blocks: int, segment_blocks: int) -> None:
        """An elastic device pool of min_blocks .. reserved_blocks, growing by segment_blocks."""
        assert 0 < min_blocks <= reserved_blocks and segment_blocks > 0
        self.device_min_blocks = min_blocks
        self.device_reserved_blocks = self._operator_ceiling_blocks = reserved_blocks
        self.device_segment_blocks = segment_blocks
        self.device_budget_bytes = reserved_blocks * self.block_bytes

    @property
    def device_ceiling_blocks(self) -> int:
        """Where the pool may grow to now (0: it never grows): the operator's ceiling, lowered by what the
        other budget holders hold of the device budget, never below the pool's minimum."""
        if not self.device_reserved_blocks:
            return 0
        room = (self.device_budget_bytes - sum(self.held_device_bytes.values())) // max(1, self.block_bytes)
        return max(self.device_min_blocks, min(self._operator_ceiling_blocks, room))

    def set_device_ceiling(self, blocks: int) -> int:
        """The operator's ceiling from now on, clamped to min .. reserved; returns the ceiling in force."""
        self._operator_ceiling_blocks = max(self.device_min_blocks, min(blocks, self.device_reserved_blocks))
        return self.device_ceiling_blocks

    def device_spare_bytes(self, pool_blocks: int) -> int:
        """Device budget neither the KV pool (at pool_blocks) nor another holder holds. Changes nothing."""
        return self.device_budget_bytes - pool_blocks * self.block_bytes - sum(self.held_device_bytes.values())

    def grant(self, plan) -> bool:
        """Grant a cache plan whole (committing the host growth it needs) or refuse it, changing nothing.
        `refuse_points` (fault tests) refuses every plan that needs one of those kinds of move."""
        if plan.points & self.refuse_points:
            self.refusals += 1
            return False
        return not plan.host_grow or self.grant_host_growth(plan.host_grow)

    def next_host_segment(self) -> int:
        """Blocks the next growth would commit (0: the budget is all committed). Changes nothing."""
        return min(self.segment_blocks, self.host_budget_blocks - self.host_committed_blocks)

    def host_room_for(self, total_blocks: int) -> bool:
        """Whether the budget and the machine (sampled now) allow total_blocks committed host slots. Changes
        no budget; a refusal is counted and logged (the cache then plans as if the host tier were full)."""
        if total_blocks > self.host_budget_blocks:
            return False
        if self._machine_room_bytes is None:
            return True
        room = self._machine_room_bytes()
        if total_blocks * self.block_bytes <= room:
            return True
        self.refusals += 1
        log.warning("host tier not grown to %d MiB: the machine has room for %d MiB now (container limit or "
                    "MemAvailable, minus the engine and --conversation-cache-min-free-mib); parked conversations "
                    "go to disk or are dropped instead", total_blocks * self.block_bytes // MIB, room // MIB,
                    extra={"fields": {"host_blocks": total_blocks, "room_bytes": room}})
        return False

    def grant_host_growth(self, blocks: int) -> bool:
        """Commit `blocks` more host slots if the budget and the machine allow; False changes nothing."""
        total = self.host_committed_blocks + blocks
        if blocks <= 0 or not self.host_room_for(total):
            return False
        self.host_committed_blocks = total
        return True

    def snapshot(self, host_used_blocks: int) -> dict[str, int]:
        """The host tier's budget, committed and used, in blocks and MiB (for /cache and the start-up line),
        and what each other budget holder holds of the device budget."""
        return {**{f"device_held_by_{name}_mib": held // MIB for name, held in self.held_device_bytes.items()},
                "host_budget_blocks": self.host_budget_blocks, "host_committed_blocks": self.host_committed_blocks,
                "host_used_blocks": host_used_blocks,
                "host_budget_mib": self.host_budget_blocks * self.block_bytes // MIB,
                "host_committed_mib": self.host_committed_blocks * self.block_bytes // MIB,
                "host_used_mib": host_used_blocks * self.block_bytes // MIB}
