"""Prefill and decode speed of qwen3next's gated DeltaNet layers on numpy, and the chunked rule against the
token-by-token one it replaces in prefill.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_qwen3next.py [--prompt 1024] [--chunk 256]

Model: a random qwen3next from tests/support/tiny_qwen3next.py at a mid size (d 512; 3 DeltaNet + 1 attention
layers; DeltaNet 4 key heads, 8 value heads of 64, conv 4; 8 experts of 256, top 2, shared expert 512).
Prints prefill tok/s (chunks of --chunk tokens), decode ms/token (one sequence and 8 at once), and the delta
rule alone on one layer's shapes: `chunked` (64-token chunks) vs `recurrent_step` called once per token.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.reference.backend import NumpyBackend  # noqa: E402
from engine.delta_rule import chunked, l2_normalize, recurrent_step  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.sequence import ModelRunner, Sequence  # noqa: E402
from tests.support.tiny_qwen3next import write_tiny_qwen3next  # noqa: E402

SIZE = dict(n_embd=512, n_head=8, n_head_kv=2, head_dim=64, rope_dims=16, n_k_heads=4, n_v_heads=8,
            k_head_dim=64, v_head_dim=64, n_expert=8, n_ff_exp=256, n_ff_shexp=512, n_ctx=4096)


def bench_model(prompt_len: int, chunk: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "q3n.gguf"
        write_tiny_qwen3next(path, seed=1, **SIZE)
        model = load_model(path, NumpyBackend())[0]
    rng = np.random.default_rng(0)
    runner = ModelRunner(model, num_blocks=4096 // 16 * 9, block_size=16)
    seq = Sequence(rng.integers(3, 270, prompt_len).tolist())
    runner.ensure_blocks(seq, prompt_len + 64)
    started = time.perf_counter()
    while seq.num_pending:
        runner.step([(seq, min(chunk, seq.num_pending))])
    prefill_s = time.perf_counter() - started
    print(f"prefill {prompt_len} tokens in chunks of {chunk}: {prefill_s:.2f} s ({prompt_len / prefill_s:.0f} tok/s)")
    for batch in (1, 8):
        seqs = [seq] + [Sequence(seq.token_ids[:prompt_len]) for _ in range(batch - 1)]
        for other in seqs[1:]:
            runner.ensure_blocks(other, prompt_len + 64)
            runner.step([(other, prompt_len)])
        started = time.perf_counter()
        for _ in range(16):
            for s in seqs:
                s.token_ids.append(5)
            runner.step([(s, 1) for s in seqs])
        per_step = (time.perf_counter() - started) / 16 * 1e3
        print(f"decode, {batch} sequence(s) at ~{prompt_len} tokens: {per_step:.1f} ms per step")
        for other in seqs[1:]:
            runner.release(other)


def bench_rule(n: int) -> None:
    rng = np.random.default_rng(0)
    heads, dk, dv = SIZE["n_v_heads"], SIZE["k_head_dim"], SIZE["v_head_dim"]
    q = l2_normalize(rng.standard_normal((heads, n, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    k = l2_normalize(rng.standard_normal((heads, n, dk)).astype(np.float32))
    v = rng.standard_normal((heads, n, dv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (heads, n)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (heads, n)).astype(np.float32)
    started = time.perf_counter()
    chunked(q, k, v, beta, g, np.zeros((heads, dk, dv), np.float32))
    chunk_s = time.perf_counter() - started
    state = np.zeros((1, heads, dk, dv), np.float32)
    started = time.perf_counter()
    for t in range(n):
        recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], beta[None, :, t], g[None, :, t], state)
    loop_s = time.perf_counter() - started
    print(f"delta rule, one layer, {n} tokens: chunked {chunk_s * 1e3:.1f} ms, token by token {loop_s * 1e3:.1f} ms "
          f"({loop_s / chunk_s:.1f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    bench_rule(args.prompt)
    bench_model(args.prompt, args.chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
