"""The MoE ops of the CUDA backend (engine/moe.py's route_experts / expert_ffn) on the kernels of moe.cu.

Without an expert cache a step stays on the device, launch shapes fixed by (T, k, E), so it can be captured in a
decode graph:

    logits [T, E] --moe_route_f32--> ids, weights [T, k] --moe_plan--> pair_rows, pair_of, groups (fixed grid)
    h [T, d] --moe_<kind> (gate rows, up rows: two launches into columns 0..F and F..2F of one y)--> [T*k, 2F]
             --gated activation--> [T*k, F] --moe_<kind> (down, x rows in pair order)--> [T*k, d]
             --moe_combine_f32 (weights, pair_of)--> [T, d]

<kind> follows the dense rule (quant_types.use_gemm): moe_matvec_<q> with groups of 8 pairs for decode
(T <= 8 token rows), moe_gemm_<q> (tensor cores, groups of 64) for prefill.

Experts live as the GGUF file stacks them: one device buffer per projection, E matrices back to back in their
blocks (`CudaExperts`); a type without a kernel is converted to F16 once at load, like every other weight.
Each expert's weight is read once per group of its pairs (8 in moe_matvec, 64 in moe_gemm). With an expert cache
(--expert-cache-mib, cuda/expert_cache/cache.py) the kernels read each expert through the layer's slot table instead
(`expert_ptr`, expert id -> device address), and the step reads its routing back to load what it needs first.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from cuda_kernels.moe import MOE_GEMM_GROUP_ROWS, MOE_GROUP_ROWS, max_groups
from engine.backends.cuda import linear as cuda_linear
from engine.backends.cuda.expert_cache.cache import CacheRound
from engine.quant_weights import _FALLBACK_DTYPES, LinearPart

log = logging.getLogger("strata.cuda")
_GATING = {"softmax": 0, "softmax_topk": 1}
_ACTIVATIONS = {"silu": "gated_silu_f32", "gelu_tanh": "gated_gelu_tanh_f32", "swiglu_oai": "gated_swiglu_oai_f32"}


@dataclass
class StackedWeight:
    """E matrices [out, in] back to back in GGUF blocks on the device."""

    suffix: str
    weight: object  # DeviceArray uint8 [E * out, row_bytes]; None when the expert cache holds the experts
    out: int
    in_dim: int

    @property
    def nbytes(self) -> int:
        return 0 if self.weight is None else self.weight.nbytes


@dataclass
class CudaExperts:
    gate: StackedWeight  # [E, F, d]
    up: StackedWeight  # [E, F, d]
    down: StackedWeight  # [E, d, F]
    n_experts: int
    gate_bias: object = None  # DeviceArray [E, F] (gpt-oss), row e at e * F: what moe_matvec indexes
    up_bias: object = None
    down_bias: object = None  # [E, d]
    cache: object = None  # cuda.expert_cache.cache.ExpertCache holding these experts (weights None then)
    cache_layer: object = None  # their cuda.expert_cache.cache.ExpertLayer

    @property
    def nbytes(self) -> int:
        biases = [b for b in (self.gate_bias, self.up_bias, self.down_bias) if b is not None]
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + sum(b.nbytes for b in biases)


def upload_experts(backend, gate: LinearPart, up: LinearPart, down: LinearPart, n_experts: int,
                   biases=(None, None, None)) -> CudaExperts:
    """A layer's stacked expert tensors: one device buffer per projection, or, with the backend's expert cache,
    the pinned host arena (device slots come at the first step); biases (gate [E, F], up [E, F], down [E, d]
    float32, or None) on the device either way."""
    bias = [None if b is None else backend.upload(b) for b in biases]
    cache = backend.expert_cache
    rows = {role: _kernel_rows(part) for role, part in zip(("gate", "up", "down"), (gate, up, down))}
    if cache is None:
        stacked = [_stacked(part, tensor_type, backend.upload_bytes(data, f"experts {part.name}"), n_experts)
                   for part, (tensor_type, data) in zip((gate, up, down), rows.values())]
        return CudaExperts(*stacked, n_experts, *bias)
    if backend.graphs is not None:  # each MoE layer reads its routing back: a host round trip, not capturable
        log.info("expert cache: decode steps are not captured in CUDA graphs (each MoE layer reads its routing back)")
        backend.graphs = None
    layer = cache.register({role: data for role, (_, data) in rows.items()}, n_experts)
    stacked = [_stacked(part, tensor_type, None, n_experts) for part, (tensor_type, _) in zip((gate, up, down),
                                                                                               rows.values())]
    return CudaExperts(*stacked, n_experts, *bias, cache=cache, cache_layer=layer)


def _kernel_rows(part: LinearPart):
    """(type, raw rows uint8 [E * out, row_bytes]) of a stacked tensor, converted to F16 rows if the kernels
    cannot read its type."""
    tensor_type, rows = part.tensor_type, part.rows
    if not cuda_linear.supports(tensor_type):
        from gguf.quants import dequantize

        values = dequantize(np.asarray(rows), tensor_type).reshape(rows.shape[0], part.in_dim)
        tensor_type = GGMLQuantizationType.F16
        rows = values.astype(_FALLBACK_DTYPES[tensor_type]).view(np.uint8)
    return tensor_type, np.ascontiguousarray(rows)


def _stacked(part: LinearPart, tensor_type, weight, n_experts: int) -> StackedWeight:
    return StackedWeight(cuda_linear.kernel_suffix(tensor_type), weight, part.out_dim // n_experts, part.in_dim)


def route_experts(backend, logits, k: int, gating: str, normalize: bool):
    """(ids int32 [T, k], weights float32 [T, k]) on the device."""
    T, E = logits.shape
    ids, weights = backend.empty((T, k), np.int32), backend.empty((T, k))
    backend.launch("moe_route_f32", ids=ids, weights=weights, logits=logits, T=T, E=E, k=k, gating=_GATING[gating],
                   normalize=int(normalize))
    return ids, weights


def expert_ffn(backend, h, experts: CudaExperts, ids, weights, activation: str):
    """sum_j weights[t, j] * expert_{ids[t, j]}(h[t]) -> [T, d], biases included where the experts have them."""
    T, k = ids.shape
    n_pairs, E = T * k, experts.n_experts
    kind = "gemm" if cuda_linear.quant_types().use_gemm(T) else "matvec"
    group_rows = MOE_GEMM_GROUP_ROWS if kind == "gemm" else MOE_GROUP_ROWS
    n_groups = max_groups(n_pairs, E, group_rows)
    plan = {name: backend.empty((size,), np.int32) for name, size in (
        ("pair_rows", n_pairs), ("pair_of", n_pairs), ("group_expert", n_groups), ("group_start", n_groups),
        ("group_len", n_groups))}
    backend.launch("moe_plan", ids=ids, n_pairs=n_pairs, k=k, E=E, max_groups=n_groups, group_rows=group_rows,
                   **plan)
    ff, d = experts.gate.out, experts.down.out
    rows = {"gate_up": backend.empty((n_pairs, 2 * ff)), "act": backend.empty((n_pairs, ff)),
            "down": backend.empty((n_pairs, d))}  # [pairs, gate | up], [pairs, F], [pairs, d] in sorted pair order
    cache = experts.cache
    if cache is None:  # every expert on the device: one round over the fixed grid (graph-capturable)
        rounds = [CacheRound((), (), (), 0, n_groups, 0, n_pairs)]
    else:  # routing read back, misses loaded round by round (cuda/expert_cache/cache.py)
        rounds = cache.begin(backend, experts.cache_layer, ids, group_rows)
    try:
        for r in rounds:
            _run_round(backend, h, experts, plan, r, kind, activation, rows)
    finally:
        if cache is not None:
            cache.finish(backend, rounds)
    out = backend.empty((T, d))
    backend.launch("moe_combine_f32", out=out, y=rows["down"], pair_of=plan["pair_of"], weights=weights, T=T, k=k,
                   d=d)
    return out


def _run_round(backend, h, experts: CudaExperts, plan: dict, r: CacheRound, kind: str, activation: str,
               rows: dict) -> None:
    """gate_up -> activation -> down for the groups [r.g0, r.g1) (pairs [r.p0, r.p1)), after the round's expert
    copies when there is a cache."""
    tables, keep = (None, None) if experts.cache is None else experts.cache.load(backend, experts.cache_layer, r)
    ff, d = experts.gate.out, experts.down.out
    groups = dict(group_expert=plan["group_expert"].ptr + 4 * r.g0, group_start=plan["group_start"].ptr + 4 * r.g0,
                  group_len=plan["group_len"].ptr + 4 * r.g0, n_groups=r.g1 - r.g0)
    for column, role, bias in ((0, "gate", experts.gate_bias), (ff, "up", experts.up_bias)):
        stacked = getattr(experts, role)
        backend.launch(f"moe_{kind}_{stacked.suffix}", y=rows["gate_up"].ptr + 4 * column, x=h, bias=bias,
                       pair_rows=plan["pair_rows"], out=ff, in_=stacked.in_dim, ld_y=2 * ff,
                       **_weight_args(stacked, tables, role), **groups)
    backend.launch(_ACTIVATIONS[activation], out=rows["act"].ptr + 4 * r.p0 * ff,
                   gate_up=rows["gate_up"].ptr + 8 * r.p0 * ff, T=r.p1 - r.p0, F=ff)
    backend.launch(f"moe_{kind}_{experts.down.suffix}", y=rows["down"], x=rows["act"], bias=experts.down_bias,
                   pair_rows=None, out=d, in_=ff, ld_y=d, **_weight_args(experts.down, tables, "down"), **groups)
    del keep  # the round's slot table may go back to the workspace once its readers are queued


def _weight_args(stacked: StackedWeight, tables, role: str) -> dict:
    """W (all experts stacked on the device) or expert_ptr (the expert cache's slot table for this projection)."""
    if tables is None:
        return {"W": stacked.weight, "expert_ptr": None}
    return {"W": None, "expert_ptr": tables[role]}
