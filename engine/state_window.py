"""Recomputing a hybrid model's recurrent state at position p from a short window over the cached K/V.

lfm2's short convolutions have a finite memory: a conv layer's state at p is its last L-1 inputs u, rows
p-L+1 .. p-1 (engine/short_conv.py). So when the conversation cache holds the K/V of every position < p
but no state checkpoint near p, the state at p can be computed again from the window [p - W, p) alone:

    tokens   ... | p-W ........................ p-1 | p ...
    K/V      cached, read by every attention row; the window writes none (its early rows are wrong)
    conv     zeros at p-W (in place of the true state)  ->  exact state at p once W >= bound

The bound, with k conv layers (in any order among the attention layers) and kernel length L: let e_j be
the first position from which conv layer j's input is exact. The first conv layer's input depends only
on the token at its position (embedding, norms, attention layers before it, whose keys and values are the
cached ones and whose query is exact), so e_1 = p - W. Conv layer j's output at t reads its inputs at
t-L+1 .. t, so it is exact from e_j + L-1 on; attention, norms and MLPs act per position (they read the
cached K/V, never the window's), so they pass that on unchanged: e_{j+1} = e_j + L-1, e_k = p-W + (k-1)(L-1).
The last conv layer's state at p needs its inputs from p-L+1 on: p-L+1 >= e_k  <=>  W >= k (L-1). With
W = k (L-1) - 1 its oldest state row depends, through the chain, on the first layer's zero at p-W-1 in
place of a real input, so the bound is tight (tests/test_state_window.py shows both). Exact in exact
arithmetic: the window's rows are computed in other batch shapes than a full prefill's, so float rounding
differs (measured in that test).

Models whose recurrent layers have unbounded memory (qwen3next's gated DeltaNet: its delta-rule matrix
sums every earlier token) have no such window: they keep using checkpoints only (window 0). A backend runs
windows when its store_kv can leave rows out (`writes_kv_rows`): numpy (batch.kv_write_rows) and CUDA (slot
-1 for those rows, which the store_kv kernels skip).
"""
from __future__ import annotations

from engine.config import ModelConfig


def state_window_tokens(config: ModelConfig) -> int:
    """Tokens W such that running [p - W, p) from zero recurrent states, reading cached K/V, gives the exact
    state at p (see the module docstring); 0 when no window does (no recurrent layers, or unbounded memory)."""
    if not config.is_hybrid or config.delta_net is not None or config.conv_kernel < 2:
        return 0
    return (config.conv_kernel - 1) * len(config.recurrent_layers)
