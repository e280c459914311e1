"""The fused decode step's attention (cpu/fused_layer.attend_heads) alone: ns a key and query head, one thread,
with each unit one query head (every head widens and walks the paged keys itself) against each unit the
heads that share a K/V head (the rows widened once for the group, as decode_step runs it when the workers
allow: fused_layer.heads_per_unit).

    .venv/bin/python scripts/bench_decode_attention.py [--keys 2048,8192] [--heads 14] [--kv-heads 2]
        [--head-dim 64] [--repeats 5]

Defaults are Qwen2.5-Coder-0.5B's (14 query heads over 2 K/V heads of 64), a float16 pool in 16-token blocks
in shuffled order, 24 layers' worth a pass; medians of --repeats passes, the two ways interleaved so a noisy
neighbour slows both alike. Both give bit-identical outputs (checked here).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.cpu.fused_layer import attend_heads  # noqa: E402

LAYERS, BLOCK = 24, 16


@njit(cache=False)
def _pass(q, k, v, table, out, n_keys, n_heads, group, per_unit):
    for _ in range(LAYERS):
        for h0 in range(0, n_heads, per_unit):
            attend_heads(q, h0, per_unit, k, v, h0 // group, n_keys - 1, table, BLOCK, 0, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="2048,8192")
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    group, rng = args.heads // args.kv_heads, np.random.default_rng(0)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.heads} query heads, "
          f"{args.kv_heads} K/V heads of {args.head_dim}, float16 pool, one thread\n")
    print("| keys | one head a unit (ns / key / head) | a K/V head's group a unit | speed-up |")
    print("| ---: | ---: | ---: | ---: |")
    for n_keys in (int(k) for k in args.keys.split(",")):
        slots = -(-n_keys // BLOCK) * BLOCK
        k, v = (rng.standard_normal((args.kv_heads, slots, args.head_dim)).astype(np.float16).view(np.uint16)
                for _ in range(2))
        q = (rng.standard_normal(args.heads * args.head_dim) * 0.1).astype(np.float32)
        table = rng.permutation(slots // BLOCK).astype(np.int64)
        outs = {per: np.zeros_like(q) for per in (1, group)}
        for per, out in outs.items():
            _pass(q, k, v, table, out, n_keys, args.heads, group, per)
        assert np.array_equal(outs[1], outs[group]), "the two ways differ"
        times = {1: [], group: []}
        for _ in range(args.repeats):
            for per in times:
                start = time.perf_counter()
                _pass(q, k, v, table, outs[per], n_keys, args.heads, group, per)
                times[per].append((time.perf_counter() - start) / (LAYERS * args.heads * n_keys) * 1e9)
        one, grouped = statistics.median(times[1]), statistics.median(times[group])
        print(f"| {n_keys} | {one:.2f} | {grouped:.2f} | {one / grouped:.2f}x |")


if __name__ == "__main__":
    main()
