"""Where one fresh prompt's prefill spends its time, in one process: tok/s and cProfile's functions by own time.

    .venv/bin/python scripts/profile_prefill.py [--model qwen2.5-coder-0.5b] [--tokens 2048] [--chunk 512]
        [--kv-type f16] [--threads 2] [--top 12]

Runs `ModelRunner.step` over a prompt of --tokens ids in --chunk-token chunks (the server's --prefill-chunk
is 512 and its K/V f16 by default): one warm-up prompt, one timed, one profiled. The kernels' own time shows
under their Python entry points (gemm_part, _attend_block, softmax_tile, ...). Compare runs within one
session; on a shared machine give the run CPU priority (docs/BENCHMARKS.md, issue 27's section).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cpu_threads import limit_threads  # noqa: E402  (engine first: it sets OpenBLAS's env before numpy)
from engine.kv import BLOCK_SIZE  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.sequence import ModelRunner, Sequence  # noqa: E402


def prefill_seconds(runner: ModelRunner, tokens: int, chunk: int, seed: int) -> float:
    seq = Sequence([(i * 7 + seed) % 30000 + 1000 for i in range(tokens)])
    runner.ensure_blocks(seq, tokens)
    start = time.perf_counter()
    while seq.num_pending:
        runner.step([(seq, min(chunk, seq.num_pending))])
    elapsed = time.perf_counter() - start
    runner.release(seq)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    limit_threads(args.threads)
    model = open_model(args.model).model
    runner = ModelRunner(model, num_blocks=-(-args.tokens // BLOCK_SIZE) + 64, kv_type=args.kv_type)
    prefill_seconds(runner, args.tokens, args.chunk, 1)  # compiles / loads the kernels, repacks the weights
    print(f"prefill {args.tokens} tokens, chunk {args.chunk}, K/V {args.kv_type}: "
          f"{args.tokens / prefill_seconds(runner, args.tokens, args.chunk, 2):.1f} tok/s")
    profile = cProfile.Profile()
    profile.enable()
    elapsed = prefill_seconds(runner, args.tokens, args.chunk, 3)
    profile.disable()
    print(f"profiled: {args.tokens / elapsed:.1f} tok/s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
