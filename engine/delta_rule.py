"""The gated delta rule of Qwen3-Next's linear-attention layers, in numpy float32.

Per value head, with q, k l2-normalised (q also times dk^-1/2), beta in (0, 1) and log-decay g <= 0, a
sequence carries a matrix S [dk, dv] from token to token:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T        o_t = S_t^T q_t

`recurrent_step` is that rule for one token of many sequences at once (decode). `chunked` computes a run
of n tokens of one sequence in chunks of C (the WY / UT form of Yang et al., "Gated Delta Networks", the
same algebra as transformers' torch_chunk_gated_delta_rule): inside a chunk everything is matrix products
and one batched triangular inverse, and only the C-token chunks are a loop, so no Python loop runs per token.

    chunk rows:  0 ........ c-1 | c ........ 2c-1 | ... | (m-1)c ... n-1 (zero-padded to mc; c = 2^j <= C)
    per chunk:   gc   = cumsum(g)                                     [H, c]
                 D    = exp(gc_i - gc_j) for j <= i, else 0           [H, c, c]
                 T    = (I + strict_lower((beta k) k^T * D))^-1
                 U    = T (beta v),  W = T (beta k exp(gc))           [H, c, dv], [H, c, dk]
    scan:        V    = U - W S                      (the part of each value the state does not predict)
                 o    = (q exp(gc)) S + ((q k^T) * D) V
                 S   <- exp(gc_last) S + (k exp(gc_last - gc))^T V

The state after any row r inside a chunk is S exp(gc_{r-1}) + (k_<r exp(gc_{r-1} - gc_<r))^T V_<r (rows of V
depend only on earlier rows), so checkpoints are taken inside a chunk without cutting it (`capture_rows`).
"""
from __future__ import annotations

import numpy as np

_F32 = np.float32
# Tokens per chunk. transformers and FLA use 64; on numpy 32 is faster (one layer of Qwen3-Next's size,
# 32 heads of 128, 1024 tokens: 297 ms at 32, 401 ms at 64, 820 ms at 16, 1750 ms token by token).
CHUNK = 32
L2_EPS = _F32(1e-6)  # transformers' l2norm (FLA's) epsilon


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x * rsqrt(sum(x^2) + eps) over the last axis."""
    return x / np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + L2_EPS)


def unit_lower_inverse(m: np.ndarray) -> np.ndarray:
    """Inverses of unit lower-triangular matrices m [..., c, c] (c a power of two), merging pairs of diagonal
    blocks of size 1, 2, 4, ...: [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]. log2(c) batched
    products; numpy's batched LU solve (np.linalg.solve) is ~50x slower on 64 x 64 systems."""
    c, batch = m.shape[-1], m.shape[:-2]
    assert c & (c - 1) == 0, f"block size {c} is not a power of two"
    inv = np.broadcast_to(np.eye(c, dtype=m.dtype), m.shape).copy()
    size = 1
    while size < c:
        pairs = np.arange(c // (2 * size))
        blocks = m.reshape(*batch, len(pairs), 2, size, len(pairs), 2, size)
        inv_blocks = inv.reshape(blocks.shape)  # a view: writing it writes inv
        lower = blocks[..., pairs, 1, :, pairs, 0, :]  # [pairs, *batch, size, size]: C of each pair
        a_inv, d_inv = inv_blocks[..., pairs, 0, :, pairs, 0, :], inv_blocks[..., pairs, 1, :, pairs, 1, :]
        inv_blocks[..., pairs, 1, :, pairs, 0, :] = -(d_inv @ lower @ a_inv)
        size *= 2
    return inv


def recurrent_step(q, k, v, beta, g, states):
    """One token per sequence: q, k [B, H, dk], v [B, H, dv], beta, g [B, H], states [B, H, dk, dv]
    (updated in place). Returns o [B, H, dv]."""
    states *= np.exp(g)[..., None, None]
    predicted = np.einsum("bhk,bhkv->bhv", k, states)  # [B, H, dv]
    delta = (v - predicted) * beta[..., None]
    states += k[..., :, None] * delta[..., None, :]
    return np.einsum("bhk,bhkv->bhv", q, states)


def chunked(q, k, v, beta, g, state, capture_rows=(), chunk: int = CHUNK):
    """n tokens of one sequence: q, k [H, n, dk], v [H, n, dv], beta, g [H, n]; state [H, dk, dv] (updated in
    place). Returns (o [H, n, dv], {r: copy of the state after r rows} for r in capture_rows, 0 < r <= n)."""
    n_heads, n = g.shape
    c = min(1 << (chunk.bit_length() - 1), 1 << (n - 1).bit_length())  # a power of two <= chunk (see
    # unit_lower_inverse), no larger than n needs
    m = -(-n // c)
    pad = m * c - n
    if pad:  # zero rows change nothing: k = 0 writes nothing, g = 0 decays nothing
        q, k, v = (np.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        beta, g = (np.pad(x, ((0, 0), (0, pad))) for x in (beta, g))
    q, k, v = (x.reshape(n_heads, m, c, x.shape[-1]) for x in (q, k, v))  # [H, m, c, d]
    beta, g = beta.reshape(n_heads, m, c), g.reshape(n_heads, m, c)
    gc = np.cumsum(g, axis=-1)  # [H, m, c]
    lower = np.tril(np.ones((c, c), dtype=bool))
    decay = np.exp(np.where(lower, gc[..., :, None] - gc[..., None, :], -np.inf))  # [H, m, c, c]
    k_beta = k * beta[..., None]
    system = np.tril((k_beta @ k.swapaxes(-1, -2)) * decay, -1) + np.eye(c, dtype=_F32)
    rhs = np.concatenate([v * beta[..., None], k_beta * np.exp(gc)[..., None]], axis=-1)
    solved = unit_lower_inverse(system) @ rhs  # [H, m, c, dv + dk]
    dv = v.shape[-1]
    u, w = solved[..., :dv], solved[..., dv:]
    intra = (q @ k.swapaxes(-1, -2)) * decay  # [H, m, c, c]
    q_decayed = q * np.exp(gc)[..., None]
    last = gc[..., -1:]  # [H, m, 1]
    k_decayed = k * np.exp(last - gc)[..., None]
    out = np.empty((n_heads, m, c, dv), dtype=_F32)
    captured = {}
    for i in range(m):
        v_new = u[:, i] - w[:, i] @ state  # [H, c, dv]
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        end = min((i + 1) * c, n)  # the state after this chunk's update is the state after `end` rows
        for r in capture_rows:
            j = r - i * c  # rows of this chunk before the captured state
            if 0 < j and r < end:
                g_j = gc[:, i, j - 1]  # [H]
                partial = (k[:, i, :j] * np.exp(g_j[:, None] - gc[:, i, :j])[..., None]).swapaxes(-1, -2)
                captured[r] = state * np.exp(g_j)[:, None, None] + partial @ v_new[:, :j]
        state *= np.exp(last[:, i])[..., None]
        state += k_decayed[:, i].swapaxes(-1, -2) @ v_new
        if end in capture_rows:
            captured[end] = state.copy()
    return out.reshape(n_heads, m * c, dv)[:, :n], captured
