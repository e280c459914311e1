"""The numpy backend with its linears and embedding table kept quantised (`--cpu-weights quantized`).

Everything but the weights and attention is the float32 numpy reference (engine/backends/reference/backend.py):
the activations, norms, RoPE and the K/V pool are unchanged; attention is the reference's computed in key
tiles (cpu/prefill_attention.py), and prefill products quantise the activations to int8
(cpu/int8_gemm.py) once the weights are repacked (measured against the float path in docs/BENCHMARKS.md). Decode steps
go through the fused layers (cpu/fused_decoder.py), whose products by default quantise the activations
to int16 (cpu/int8_matvec.py; `--cpu-weights quantized-int8act`: int8 as llama.cpp does,
`quantized-f32act`: float32).
Weights arrive as raw GGUF rows (engine/quant_weights.py) and become `QuantLinear`s
(engine/backends/cpu/quant_linear.py); a type without a CPU kernel is dequantised to F32 rows at load.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import replace

import numpy as np
from gguf import GGMLQuantizationType

from engine.backends.cpu import activation as cpu_activation
from engine.backends.cpu.fused_decoder import FusedDecoder, fused_refusal, int8_refusal
from engine.backends.cpu.prefill_attention import attend_tiled
from engine.backends.cpu.quant_linear import KERNEL_KINDS, QuantLinear
from engine.backends.reference.backend import NumpyBackend
from engine.quant_weights import LinearPart
from engine.units import MIB

_F32 = np.float32
log = logging.getLogger("strata.numpy")


class QuantizedNumpyBackend(NumpyBackend):
    """NumpyBackend whose `linear` and `embedding` also accept QuantLinear weights."""

    capabilities = replace(
        NumpyBackend.capabilities, compiles_lazily=True, quantized_linears=True, quantized_embedding=True,
        fallback_quant_type=GGMLQuantizationType.F32)  # exact, unlike the GPU's F16 fallback

    def __init__(self, fused_decode: bool = True, activations: str = "int16"):
        # fused_decode: decode steps run through fused_decoder (False: the unfused reference path);
        # activations: what its products quantise the activations to (int16, int8; f32: nothing).
        self.fused_decode = fused_decode
        self.activations = activations
        self._fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> FusedDecoder | None

    def supports_quant_type(self, tensor_type: GGMLQuantizationType) -> bool:
        return tensor_type in KERNEL_KINDS

    def upload_linear_quantized(self, parts: list[LinearPart]) -> QuantLinear:
        """Raw rows stacked along the output dimension; kept as given (mmap views where possible)."""
        return QuantLinear(parts)

    def upload_embedding_quantized(self, part: LinearPart) -> QuantLinear:
        """The token table as raw rows: a lookup decodes only the rows of the batch's tokens."""
        return QuantLinear([part])

    def linear(self, x: np.ndarray, weight, bias: np.ndarray | None = None) -> np.ndarray:
        if not isinstance(weight, QuantLinear):
            return super().linear(x, weight, bias)
        y = weight.matmul(x)  # [T, out]
        if bias is not None:
            y += bias
        return y

    def embedding(self, table, token_ids: np.ndarray, scale: float) -> np.ndarray:
        if not isinstance(table, QuantLinear):
            return super().embedding(table, token_ids, scale)
        rows = table.gather(token_ids)  # [T, d]
        if scale != 1.0:
            rows *= _F32(scale)
        return rows

    def gated_activation(self, gate_up: np.ndarray, kind: str) -> np.ndarray:
        """NumpyBackend.gated_activation in cache-sized row blocks (cpu/activation.py), bit-identical."""
        if kind in cpu_activation.KERNEL_ACTIVATIONS and gate_up.dtype == _F32:
            return cpu_activation.gated_activation(gate_up, kind)
        return super().gated_activation(gate_up, kind)

    def attention(self, q, pool, layer: int, batch, scale: float, window: int, sinks: np.ndarray | None = None):
        """NumpyBackend.attention (the reference) computed key tile by key tile (cpu/prefill_attention.py):
        the scores of a tile, not of the whole context, and the softmax on every kernel thread."""
        out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=_F32)
        for seq in batch.seqs:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = attend_tiled(q[rows], pool.k[layer], pool.v[layer], seq, batch.block_size, scale, window,
                                     sinks)
        return out

    def run_forward(self, model, batch, pool) -> np.ndarray:
        """A decode step through the fused layers when it can (cpu/fused_decoder.py), else model.forward."""
        fused = self._fused_decoder(model) if self.fused_decode else None
        if fused is not None and fused.accepts(batch, pool):
            return fused.forward(batch, pool)
        return model.forward(batch, pool)

    def prepare_decode(self, model) -> None:
        """Build the model's fused decoder now (repacking the weights for integer activations: 1.5-7 s; the
        repacked copy then replaces the raw rows), at start-up instead of in the first decode step."""
        if self.fused_decode and (decoder := self._fused_decoder(model)) is not None and decoder.released_bytes:
            log.info("repacked weights replace the file's rows: %.0f MiB of mapped pages handed back",
                     decoder.released_bytes / MIB)

    def _fused_decoder(self, model) -> FusedDecoder | None:
        if model not in self._fused:
            reason = fused_refusal(model)
            if reason is not None:
                log.info("fused decode off for %s: %s; decode steps run the unfused path", model.config.arch, reason)
            activations = self.activations
            if activations != "f32" and reason is None and (why := int8_refusal(model)) is not None:
                log.info("integer activations off for %s: %s; float32 activations", model.config.arch, why)
                activations = "f32"
            self._fused[model] = None if reason else FusedDecoder(model, activations)
        return self._fused[model]

    def for_stage(self, stage: int) -> "QuantizedNumpyBackend":
        return self

    def sibling(self) -> "QuantizedNumpyBackend":
        return self
