"""Model configuration read from GGUF metadata into one frozen dataclass per model.

One config shape covers every supported architecture; per-architecture differences are flags
(qk norm, qkv bias, post norms, activation, sliding-window layers) so the model code stays a single file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from engine.moe_config import MOE_ARCHITECTURES, moe_overrides
from engine.qwen3next_config import DeltaNetShape, qwen3next_overrides

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "lfm2", "qwen3next") + MOE_ARCHITECTURES

# llama.cpp marks every 6th gemma3 layer global and the rest sliding-window (set_swa_pattern(6)).
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model's shape and arithmetic."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float  # rope base of global layers
    rope_base_local: float  # rope base of sliding-window layers (== rope_base where there are none)
    rope_dims: int  # rotated dims per head (partial rotary when < head_dim)
    rope_linear_scale: float  # positions are divided by this on global layers (1.0 = none)
    sliding_window: int  # 0 = no sliding-window layers
    layer_is_sliding: tuple[bool, ...]
    attn_scale: float
    embed_scale: float
    activation: str  # "silu" or "gelu_tanh"
    has_qkv_bias: bool
    has_qk_norm: bool
    has_post_norms: bool  # gemma3: norms on the attention and MLP outputs before the residual add
    permuted_qk: bool  # llama.cpp's converter interleaved the Q/K rows of this arch for its RoPE

    # -- mixture of experts (qwen3moe, gpt-oss; engine/moe_config.py reads them). 0 experts = dense FFN --
    n_experts: int = 0
    n_experts_used: int = 0  # top-k experts per token
    expert_ffn_dim: int = 0  # F of one expert (gate and up are [F, d], down [d, F])
    expert_gating: str = "softmax"  # "softmax": softmax over all, then top-k; "softmax_topk": top-k, then softmax
    expert_weights_norm: bool = False  # renormalise the k selected weights to sum to 1 (norm_topk_prob)
    expert_weights_scale: float = 1.0
    expert_activation: str = "silu"  # "silu" (SwiGLU) or "swiglu_oai" (gpt-oss: clamped, (up + 1))
    # -- gpt-oss attention extras and YaRN RoPE (rope_yarn_factor 0 = no YaRN) --
    has_attn_out_bias: bool = False
    has_attn_sinks: bool = False  # one learned logit per head joins every softmax's denominator
    rope_yarn_factor: float = 0.0
    rope_yarn_orig_ctx: int = 0
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    # -- hybrid models (lfm2): layers that keep a recurrent state instead of K/V (engine/short_conv.py) --
    # llama.cpp marks them with head_count_kv 0 in its per-layer list; () means every layer is attention.
    layer_is_recurrent: tuple[bool, ...] = ()
    conv_kernel: int = 0  # short-convolution length L ({arch}.shortconv.l_cache); the state keeps L - 1 rows
    # -- qwen3next (engine/qwen3next_config.py): gated DeltaNet layers, gated attention, a shared expert --
    delta_net: DeltaNetShape | None = None  # the recurrent layers are gated DeltaNet (else lfm2 short convs)
    has_attn_gate: bool = False  # each head's Q rows are [query | gate]; out *= sigmoid(gate) before wo
    shared_expert_ffn_dim: int = 0  # 0 = no shared expert

    @property
    def is_hybrid(self) -> bool:
        """Some layers carry a recurrent state: a cached prefix is only usable where a checkpoint is."""
        return any(self.layer_is_recurrent)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.layer_is_recurrent) if r)

    @property
    def n_kv_layers(self) -> int:
        """Layers that keep K/V (every layer but the recurrent ones): a K/V pool holds only these."""
        return self.n_layers - sum(self.layer_is_recurrent)

    def kv_index(self, layer: int) -> int:
        """K/V layers before `layer`: its index in a pool of every layer (layer == n_layers: their count)."""
        return layer - sum(self.layer_is_recurrent[:layer])

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


def config_from_gguf(fields: dict[str, Any], vocab_size: int) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata; raise ValueError naming anything unsupported."""
    arch = str(fields.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    n_layers = int(get("block_count"))
    d_model = int(get("embedding_length"))
    n_heads = _first_int(get("attention.head_count"))
    kv_heads_field = get("attention.head_count_kv", n_heads)
    layer_is_recurrent = _recurrent_layers(arch, kv_heads_field, n_layers)
    if layer_is_recurrent:  # per-layer list with 0 on the short-conv layers
        kv_heads_field = [int(h) for h in kv_heads_field if int(h) > 0]
    n_kv_heads = _first_int(kv_heads_field)
    head_dim = int(get("attention.key_length", d_model // n_heads))
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} attention heads are not a multiple of {n_kv_heads} KV heads")
    rope_base = float(get("rope.freq_base", 10_000.0))
    is_gemma3 = arch == "gemma3"
    sliding_window = int(fields.get(f"{arch}.attention.sliding_window", 0) or 0) if is_gemma3 else 0
    layer_is_sliding = tuple(
        bool(sliding_window) and (i + 1) % GEMMA3_SWA_PATTERN != 0 for i in range(n_layers)
    )
    scaling_type = fields.get(f"{arch}.rope.scaling.type", "none")
    rope_linear_scale = float(fields.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling_type == "yarn" and arch in MOE_ARCHITECTURES:
        rope_linear_scale = 1.0  # YaRN is read by moe_overrides
    elif scaling_type not in ("none", "linear") and rope_linear_scale != 1.0:
        raise ValueError(f"unsupported rope scaling type {scaling_type!r}")
    config = ModelConfig(
        arch=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=_first_int(get("feed_forward_length")),
        vocab_size=vocab_size,
        context_length=int(get("context_length", 4096)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=rope_base,
        rope_base_local=GEMMA3_LOCAL_ROPE_BASE if sliding_window else rope_base,
        rope_dims=int(fields.get(f"{arch}.rope.dimension_count", head_dim) or head_dim),
        rope_linear_scale=rope_linear_scale,
        sliding_window=sliding_window,
        layer_is_sliding=layer_is_sliding,
        attn_scale=1.0 / math.sqrt(head_dim),
        embed_scale=math.sqrt(d_model) if is_gemma3 else 1.0,
        activation="gelu_tanh" if is_gemma3 else "silu",
        has_qkv_bias=arch == "qwen2",
        has_qk_norm=arch in ("qwen3", "gemma3", "lfm2"),
        has_post_norms=is_gemma3,
        permuted_qk=arch == "llama",
        layer_is_recurrent=layer_is_recurrent,
        conv_kernel=int(get("shortconv.l_cache")) if layer_is_recurrent else 0,
    )
    if arch in MOE_ARCHITECTURES:
        config = replace(config, **moe_overrides(arch, fields, n_layers))
    if arch == "qwen3next":
        config = replace(config, **qwen3next_overrides(fields, n_layers))
    return config


def _recurrent_layers(arch: str, kv_heads: Any, n_layers: int) -> tuple[bool, ...]:
    """lfm2: the layers whose head_count_kv entry is 0 are short-conv layers; () for every other arch."""
    if arch != "lfm2":
        return ()
    if not isinstance(kv_heads, (list, tuple)) or len(kv_heads) != n_layers:
        raise ValueError(f"lfm2 GGUF needs a per-layer {arch}.attention.head_count_kv list of {n_layers} values")
    flags = tuple(int(h) == 0 for h in kv_heads)
    if all(flags):
        raise ValueError("lfm2 GGUF has no attention layer (every head_count_kv entry is 0)")
    return flags


def _first_int(value: Any) -> int:
    # Some GGUFs store per-layer lists (e.g. head counts); the supported archs are uniform.
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer varying value {value!r} is not supported")
        return int(value[0])
    return int(value)
