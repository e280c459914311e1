"""Launch geometry of moe.cu, and the host side of the grouped expert products: pairs sorted into groups.

moe_route_f32: one warp per token row, 4 rows a CTA. moe_plan: one CTA of 256 threads (thread e: expert e).
moe_matvec_<q>: matvec_<q>'s CTA (4 warps of 4 output rows) on grid (ceil(out / 16), n_groups), groups of <= 8
pairs. moe_gemm_<q>: gemm_<q>'s CTA (128 threads, a 64 x 64 tile) on grid (ceil(out / 64), n_groups), groups of
<= 64 pairs. gated_swiglu_oai_f32, moe_combine_f32: one thread per output element.
"""
from __future__ import annotations

import numpy as np

from cuda_kernels.launch import cdiv, flat_geometry, unknown_kernel

MOE_ROUTE_WARPS = 4      # must match moe.cu
MOE_MAX_EXPERTS = 256    # 32 lanes x MOE_MAX_PER_LANE
MOE_MAX_K = 16
MOE_ROWS_PER_CTA = 16    # MOE_WARPS_PER_CTA x MOE_ROWS_PER_WARP
MOE_GROUP_ROWS = 8       # pairs per group of moe_matvec
MOE_GEMM_GROUP_ROWS = 64  # pairs per group of moe_gemm (its tile's GEMM_BN)
MOE_GEMM_ROWS_PER_CTA = 64  # GEMM_BM


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from a moe.cu kernel's int arguments; ValueError on bad shapes."""
    if kernel == "moe_route_f32":
        E, k = ints["E"], ints["k"]
        if not (1 <= k <= min(E, MOE_MAX_K) and E <= MOE_MAX_EXPERTS):
            raise ValueError(f"moe_route_f32 takes 1 <= k <= min(E, {MOE_MAX_K}) and E <= {MOE_MAX_EXPERTS}, "
                             f"got E={E} k={k}")
        return (max(1, cdiv(ints["T"], MOE_ROUTE_WARPS)), 1, 1), (32 * MOE_ROUTE_WARPS, 1, 1), 0
    if kernel.startswith(("moe_matvec_", "moe_gemm_")):
        in_dim = ints.get("in_", ints.get("in", 0))  # the emulator passes in_, tests/support/kernel_gpu.py in
        if ints["out"] <= 0 or in_dim <= 0 or ints["ld_y"] < ints["out"]:
            raise ValueError(f"{kernel}: need out > 0, in > 0 and ld_y >= out, got {ints}")
        rows = MOE_ROWS_PER_CTA if kernel.startswith("moe_matvec_") else MOE_GEMM_ROWS_PER_CTA
        return (cdiv(ints["out"], rows), max(1, ints["n_groups"]), 1), (128, 1, 1), 0
    if kernel == "moe_plan":
        group_rows = ints["group_rows"]
        if not (1 <= ints["E"] <= MOE_MAX_EXPERTS and group_rows in (MOE_GROUP_ROWS, MOE_GEMM_GROUP_ROWS)
                and ints["max_groups"] >= max_groups(ints["n_pairs"], ints["E"], group_rows)):
            raise ValueError(f"moe_plan needs 1 <= E <= {MOE_MAX_EXPERTS}, group_rows 8 or 64 and max_groups >= "
                             f"max_groups(n_pairs, E, group_rows), got {ints}")
        return (1, 1, 1), (MOE_MAX_EXPERTS, 1, 1), 0
    if kernel == "gated_swiglu_oai_f32":
        return flat_geometry(ints["T"] * ints["F"])
    if kernel == "moe_combine_f32":
        return flat_geometry(ints["T"] * ints["d"])
    raise unknown_kernel("moe.cu", kernel)


def max_groups(n_pairs: int, n_experts: int, group_rows: int = MOE_GROUP_ROWS) -> int:
    """The most groups n_pairs pairs can form: every expert may leave one partial group."""
    return min(n_pairs, cdiv(n_pairs, group_rows) + n_experts)


def plan_groups(ids: np.ndarray, group_rows: int = MOE_GROUP_ROWS) -> dict[str, np.ndarray]:
    """The (token, slot) pairs of ids [T, k] sorted by expert (stable) and cut into groups of at most
    group_rows pairs of one expert (8 for moe_matvec_<q>, 64 for moe_gemm_<q>), as int32 arrays for those
    kernels and moe_combine_f32:

        pair_rows [T*k]   token (x row) of sorted pair p
        pair_of   [T*k]   sorted position of pair t * k + j (the inverse permutation)
        group_expert, group_start, group_len [n_groups]
    """
    T, k = ids.shape
    flat = ids.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")  # sorted position -> pair index t * k + j
    pair_of = np.empty_like(order)
    pair_of[order] = np.arange(order.size)
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    group_expert, group_start, group_len = [], [], []
    for expert, start, count in zip(experts, starts, counts):
        for offset in range(0, int(count), group_rows):
            group_expert.append(expert)
            group_start.append(start + offset)
            group_len.append(min(group_rows, int(count) - offset))
    as32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
    return {"pair_rows": as32(order // k), "pair_of": as32(pair_of), "group_expert": as32(group_expert),
            "group_start": as32(group_start), "group_len": as32(group_len)}
