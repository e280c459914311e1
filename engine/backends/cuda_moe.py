"""The MoE ops of the CUDA backend (engine/moe.py's route_experts / expert_ffn) on the kernels of moe.cu.

A step stays on the device, with launch shapes fixed by (T, k, E), so it can be captured in a decode graph:

    logits [T, E] --moe_route_f32--> ids, weights [T, k] --moe_plan--> pair_rows, pair_of, groups (fixed grid)
    h [T, d] --moe_matvec (gate rows, up rows: two launches into columns 0..F and F..2F of one y)--> [T*k, 2F]
             --gated activation--> [T*k, F] --moe_matvec (down, x rows in pair order)--> [T*k, d]
             --moe_combine_f32 (weights, pair_of)--> [T, d]

Experts live as the GGUF file stacks them: one device buffer per projection, E matrices back to back in their
blocks (`CudaExperts`); a type without a kernel is converted to F16 once at load, like every other weight.
Each expert's weight is read once per group of up to 8 of its pairs (grouped matvec; no grouped gemm yet, so a
long prefill re-reads an expert once per 8 of its tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from cuda_kernels.moe import max_groups
from engine.backends import cuda_linear
from engine.quant_weights import _FALLBACK_DTYPES, LinearPart

_GATING = {"softmax": 0, "softmax_topk": 1}
_ACTIVATIONS = {"silu": "gated_silu_f32", "gelu_tanh": "gated_gelu_tanh_f32", "swiglu_oai": "gated_swiglu_oai_f32"}


@dataclass
class StackedWeight:
    """E matrices [out, in] back to back in GGUF blocks on the device."""

    suffix: str
    weight: object  # DeviceArray uint8 [E * out, row_bytes]
    out: int
    in_dim: int

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


@dataclass
class CudaExperts:
    gate: StackedWeight  # [E, F, d]
    up: StackedWeight  # [E, F, d]
    down: StackedWeight  # [E, d, F]
    n_experts: int
    gate_bias: object = None  # DeviceArray [E, F] (gpt-oss), row e at e * F: what moe_matvec indexes
    up_bias: object = None
    down_bias: object = None  # [E, d]

    @property
    def nbytes(self) -> int:
        biases = [b for b in (self.gate_bias, self.up_bias, self.down_bias) if b is not None]
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + sum(b.nbytes for b in biases)


def upload_stacked(backend, part: LinearPart, n_experts: int) -> StackedWeight:
    """A stacked expert tensor's raw rows ([E * out, row_bytes]) to the device, converted to F16 rows if the
    kernels cannot read its type."""
    tensor_type, rows = part.tensor_type, part.rows
    if not cuda_linear.supports(tensor_type):
        from gguf.quants import dequantize

        values = dequantize(np.asarray(rows), tensor_type).reshape(rows.shape[0], part.in_dim)
        tensor_type = GGMLQuantizationType.F16
        rows = values.astype(_FALLBACK_DTYPES[tensor_type]).view(np.uint8)
    weight = backend.upload_bytes(np.ascontiguousarray(rows), f"experts {part.name}")
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
    n_groups = max_groups(n_pairs, E)
    plan = {name: backend.empty((size,), np.int32) for name, size in (
        ("pair_rows", n_pairs), ("pair_of", n_pairs), ("group_expert", n_groups), ("group_start", n_groups),
        ("group_len", n_groups))}
    backend.launch("moe_plan", ids=ids, n_pairs=n_pairs, k=k, E=E, max_groups=n_groups, **plan)
    groups = dict(group_expert=plan["group_expert"], group_start=plan["group_start"], group_len=plan["group_len"],
                  n_groups=n_groups)
    ff = experts.gate.out
    gate_up = backend.empty((n_pairs, 2 * ff))  # [pairs, gate | up]
    for column, stacked, bias in ((0, experts.gate, experts.gate_bias), (ff, experts.up, experts.up_bias)):
        backend.launch(f"moe_matvec_{stacked.suffix}", y=gate_up.ptr + 4 * column, W=stacked.weight, x=h, bias=bias,
                       pair_rows=plan["pair_rows"], out=ff, in_=stacked.in_dim, ld_y=2 * ff, **groups)
    act = backend.empty((n_pairs, ff))
    backend.launch(_ACTIVATIONS[activation], out=act, gate_up=gate_up, T=n_pairs, F=ff)
    d = experts.down.out
    down = backend.empty((n_pairs, d))
    backend.launch(f"moe_matvec_{experts.down.suffix}", y=down, W=experts.down.weight, x=act, bias=experts.down_bias,
                   pair_rows=None, out=d, in_=ff, ld_y=d, **groups)
    out = backend.empty((T, d))
    backend.launch("moe_combine_f32", out=out, y=down, pair_of=plan["pair_of"], weights=weights, T=T, k=k, d=d)
    return out
