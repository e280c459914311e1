"""Loading one MoE layer's router and stacked experts from GGUF into ExpertWeights (engine/moe.py).

GGUF stores the E experts of a projection as one 3-D tensor, numpy order [E, rows, cols] (llama.cpp's
converter stacks them): ffn_gate_exps / ffn_up_exps [E, F, d], ffn_down_exps [E, d, F], or gate and up
fused as ffn_gate_up_exps [E, 2F, d] (gate rows first). Expert e's matrix is rows e*R .. (e+1)*R - 1 of
the tensor read as [E*R, cols], so

- float32 backends get one stacked [E, 2F, d] gate_up array and [E, d, F] down array, and each expert's
  linear is a view of them (no copy per expert);
- backends with `upload_linear_quantized` get each expert as raw GGUF row slices of the memory-mapped
  file (gate rows + up rows as two parts), never dequantised; a type without a kernel there (MXFP4 on
  numpy) is dequantised once per tensor by the gguf package to the backend's fallback type, with one
  warning naming the tensor.
"""
from __future__ import annotations

import logging

import numpy as np

from engine.gguf_file import GGUFFile
from engine.moe import ExpertWeights
from engine.quant_weights import _FALLBACK_DTYPES, LinearPart
from engine.units import MIB

log = logging.getLogger("strata.weights")
# The FFN input norm's tensor where an arch does not call it ffn_norm (gpt-oss: llama.cpp's ATTN_POST_NORM).
FFN_NORM_TENSOR = {"gpt-oss": "post_attention_norm.weight", "qwen3next": "post_attention_norm.weight"}


def load_moe_layer(gguf: GGUFFile, prefix: str, backend, linear) -> ExpertWeights:
    """ExpertWeights of layer `prefix` ("blk.3."); `linear(names)` is load_weights' linear uploader."""
    opt = lambda name: backend.upload(gguf.tensor(name)) if gguf.has_tensor(name) else None  # noqa: E731
    fused = gguf.has_tensor(prefix + "ffn_gate_up_exps.weight")
    gate_up_names = ([prefix + "ffn_gate_up_exps.weight"] if fused
                     else [prefix + "ffn_gate_exps.weight", prefix + "ffn_up_exps.weight"])
    down_name = prefix + "ffn_down_exps.weight"
    device = None
    if backend.capabilities.stacked_experts:  # cuda: one stacked buffer per projection, biases with them
        gate_up, down = [], []
        biases = _split_gate_up_bias(gguf, prefix, fused) + (_host_opt(gguf, prefix + "ffn_down_exps.bias"),)
        device = backend.upload_experts(*_stacked_parts(gguf, gate_up_names, down_name),
                                        gguf.tensor_shape(down_name)[0], biases)
    elif backend.capabilities.quantized_linears:
        gate_up_parts = [_expert_parts(gguf, n, backend) for n in gate_up_names]
        down_parts = _expert_parts(gguf, down_name, backend)
        gate_up = [backend.upload_linear_quantized([p[e] for p in gate_up_parts]) for e in range(len(down_parts))]
        down = [backend.upload_linear_quantized([p]) for p in down_parts]
    else:
        stacked = np.concatenate([gguf.tensor(n) for n in gate_up_names], axis=1)  # [E, 2F, d]
        down_stacked = gguf.tensor(down_name)  # [E, d, F]
        gate_up = [backend.upload_linear(stacked[e]) for e in range(stacked.shape[0])]
        down = [backend.upload_linear(down_stacked[e]) for e in range(down_stacked.shape[0])]
    return ExpertWeights(
        router=linear([prefix + "ffn_gate_inp.weight"]),
        router_bias=opt(prefix + "ffn_gate_inp.bias"),
        gate_up=gate_up,
        down=down,
        gate_up_bias=None if device is not None else _gate_up_bias(gguf, prefix, fused, backend),
        down_bias=None if device is not None else opt(prefix + "ffn_down_exps.bias"),
        device=device,
    )


def _host_opt(gguf: GGUFFile, name: str):
    return gguf.tensor(name) if gguf.has_tensor(name) else None


def _split_gate_up_bias(gguf: GGUFFile, prefix: str, fused: bool) -> tuple:
    """(gate [E, F], up [E, F]) bias arrays, or (None, None)."""
    if fused:
        both = _host_opt(gguf, prefix + "ffn_gate_up_exps.bias")  # [E, 2F]
        return (None, None) if both is None else tuple(np.ascontiguousarray(h) for h in np.split(both, 2, axis=1))
    return _host_opt(gguf, prefix + "ffn_gate_exps.bias"), _host_opt(gguf, prefix + "ffn_up_exps.bias")


def _stacked_parts(gguf: GGUFFile, gate_up_names: list[str], down_name: str) -> list[LinearPart]:
    """(gate, up, down) as LinearParts of all E experts' rows ([E * R, row_bytes], views where possible);
    a fused ffn_gate_up_exps is split into its gate and up halves (one copy at load)."""
    def whole(name: str) -> LinearPart:
        n_experts, n_rows, n_cols = gguf.tensor_shape(name)
        tensor_type, raw = gguf.tensor_raw(name)
        return LinearPart(tensor_type, raw.reshape(n_experts * n_rows, -1), n_experts * n_rows, n_cols, name)

    if len(gate_up_names) == 2:
        return [whole(gate_up_names[0]), whole(gate_up_names[1]), whole(down_name)]
    fused = whole(gate_up_names[0])
    n_experts = gguf.tensor_shape(gate_up_names[0])[0]
    halves = fused.rows.reshape(n_experts, 2, -1, fused.rows.shape[1])  # [E, gate|up, F, row_bytes]
    gate, up = (np.ascontiguousarray(halves[:, i]).reshape(fused.out_dim // 2, -1) for i in (0, 1))
    half = fused.out_dim // 2  # _replace is namedtuple's public API (the underscore only avoids field names)
    return [fused._replace(rows=gate, out_dim=half), fused._replace(rows=up, out_dim=half), whole(down_name)]


def _gate_up_bias(gguf: GGUFFile, prefix: str, fused: bool, backend):
    names = [prefix + "ffn_gate_up_exps.bias"] if fused else [prefix + "ffn_gate_exps.bias", prefix + "ffn_up_exps.bias"]
    if not all(gguf.has_tensor(n) for n in names):
        return None
    return backend.upload(np.concatenate([gguf.tensor(n) for n in names], axis=1))  # [E, 2F]


def _expert_parts(gguf: GGUFFile, name: str, backend) -> list[LinearPart]:
    """The E experts of a stacked tensor [E, R, C] as LinearParts of R rows each (views, no copy)."""
    n_experts, n_rows, n_cols = gguf.tensor_shape(name)
    tensor_type, raw = gguf.tensor_raw(name)
    rows = raw.reshape(n_experts * n_rows, -1)  # [E*R, row_bytes]
    if not backend.supports_quant_type(tensor_type):
        fallback = backend.capabilities.fallback_quant_type
        dtype = _FALLBACK_DTYPES[fallback]
        log.warning("tensor %s: no kernel for type %s on this backend, uploading it dequantised as %s (%d MiB)",
                    name, tensor_type.name, fallback.name, rows.shape[0] * n_cols * np.dtype(dtype).itemsize // MIB)
        values = gguf.tensor(name).reshape(n_experts * n_rows, n_cols).astype(dtype)
        tensor_type, rows = fallback, values.view(np.uint8)
    return [LinearPart(tensor_type, rows[e * n_rows : (e + 1) * n_rows], n_rows, n_cols, f"{name}[{e}]")
            for e in range(n_experts)]
