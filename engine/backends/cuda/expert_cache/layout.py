"""The expert cache's layout facts: a layer's experts in the pinned arena and a slot, and one round of a layer's
step (engine/backends/cuda/expert_cache/cache.py).

    host arena of a layer:  [gate E x F rows | up E x F rows | down E x d rows]    as in the GGUF
    slot:                   [gate_e | up_e | down_e], each matrix SLOT_ALIGN-aligned
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends.cuda.device import PinnedBuffer

ROLES = ("gate", "up", "down")
SLOT_ALIGN = 256  # each matrix of a slot starts aligned, whatever its rows' byte length


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


def round_ranges(r, plan) -> CacheRound:
    """A slots Round with its groups and pairs in the layer's sorted pair plan (cuda_kernels.moe.plan_groups)."""
    group_expert = plan["group_expert"]
    g0 = int(np.searchsorted(group_expert, r.experts[0], "left"))
    g1 = int(np.searchsorted(group_expert, r.experts[-1], "right"))
    p0 = int(plan["group_start"][g0])
    p1 = int(plan["group_start"][g1 - 1] + plan["group_len"][g1 - 1])
    return CacheRound(r.experts, r.loads, r.evicted, g0, g1, p0, p1, r.slots)
