"""What a backend can do beyond the Backend protocol's required ops, declared once on its class
(`capabilities = Capabilities(...)`) instead of probed with hasattr / getattr / `name ==` where it is used.

The defaults are the least a backend may offer (float32 K/V, float32 weights, attention layers, no MoE):
a backend states what it adds. The loader (engine/backends/placement.py) and the model code read these
fields; nothing else decides what a backend can run.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

# The layer kinds of engine/model.py a backend may compute: attention everywhere; lfm2's short convolutions
# (engine/short_conv.py); qwen3next's gated DeltaNet (engine/gated_deltanet.py, numpy arrays only).
ATTENTION, SHORT_CONV, DELTA_NET = "attention", "short_conv", "delta_net"


@dataclass(frozen=True)
class Capabilities:
    """A backend's declared capabilities. Immutable; one per backend class (a subclass may `replace` it)."""

    on_host: bool = True  # arrays, weights and the K/V pool live in this process's RAM (numpy); else a device's
    compiles_lazily: bool = False  # kernels compile at their first call (numba): warm-up runs a plan first
    kv_types: tuple[str, ...] = ("f32",)  # --kv-type values it stores; the first is --kv-type auto's
    writes_kv_rows: bool = False  # store_kv writes only batch.kv_write_rows (state windows, engine/state_window.py)
    quantized_linears: bool = False  # upload_linear_quantized(parts) / supports_quant_type(type): raw GGUF rows
    quantized_embedding: bool = False  # upload_embedding_quantized(part): the token table as raw rows too
    fallback_quant_type: GGMLQuantizationType = GGMLQuantizationType.F16  # a type without a kernel becomes this
    moe: bool = False  # route_experts / expert_ffn (engine/moe.py)
    stacked_experts: bool = False  # upload_experts(gate, up, down, ...): one buffer per projection (cuda)
    attention_sinks: bool = False  # attention(..., sinks=): gpt-oss's per-head extra logit
    expert_cache: bool = False  # --expert-cache-mib: experts in host memory, the hot ones in device slots
    queued_moves: bool = False  # block moves are queued, not done on return: move_fence() / wait_for(event, mover)
    layer_kinds: frozenset[str] = frozenset({ATTENTION})  # the mixers it computes (see above)
