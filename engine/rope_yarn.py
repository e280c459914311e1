"""YaRN RoPE tables (gpt-oss): per-frequency blend of interpolated and extrapolated rotation, plus mscale.

YaRN (arXiv 2309.00071) keeps the fast-rotating dimensions as trained (extrapolation), divides the slow
ones' frequency by `factor` (interpolation), and ramps linearly between the two over the dimension range
whose wavelengths fit between beta_fast and beta_slow rotations in the original context. cos and sin are
then scaled by mscale = 1 + 0.1 ln(factor), which sharpens attention by mscale^2.

    dim pair j:    0 ........ low ......... high ........ dims/2 - 1
    frequency:     base^(-2j/dims)      ramp           base^(-2j/dims) / factor

This is llama.cpp's ggml_rope_yarn (corr dims floored/ceiled, as ggml_rope_yarn_corr_dims does) and
transformers' _compute_yarn_parameters with truncate=True, the value its GGUF loader gets.
"""
from __future__ import annotations

import math

import numpy as np


def yarn_inv_freq(base: float, rope_dims: int, factor: float, orig_ctx: int, beta_fast: float,
                  beta_slow: float) -> tuple[np.ndarray, float]:
    """(inv_freq [rope_dims / 2] float64, mscale) of YaRN scaling."""
    def correction_dim(rotations: float) -> float:
        return rope_dims * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dims - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    extrapolated = 1.0 / base ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)
    interpolated = extrapolated / factor
    ramp = np.clip((np.arange(rope_dims // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 = extrapolate (fast dims), 0 = interpolate (slow dims)
    mscale = 1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0
    return interpolated * (1.0 - keep) + extrapolated * keep, mscale


def yarn_rope_tables(config, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_positions, rope_dims / 2] float32 of a config with rope_yarn_factor > 0."""
    c = config
    inv_freq, mscale = yarn_inv_freq(c.rope_base, c.rope_dims, c.rope_yarn_factor, c.rope_yarn_orig_ctx,
                                     c.rope_yarn_beta_fast, c.rope_yarn_beta_slow)
    positions = np.arange(max_positions, dtype=np.float32)
    angles = np.outer(positions, inv_freq.astype(np.float32)).astype(np.float32)  # float32 like the references
    scale = np.float32(mscale)
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)
