"""Throughput of the integer decode products (cpu.int8_matvec._part_rows, serial code: one thread), by weight type,
matrix size and tokens a step; prints a markdown table of Gweights/s (weight-token products a second).

    .venv/bin/python scripts/bench_decode_kernels.py [--types q4_1,q8_0,q6_k] [--tokens 1,2,4,8]
                                                     [--shapes 3072x576,196608x576] [--repeats 7]

Rows are random GGUF blocks repacked as a model's are (float16 scales where the type allows). A shape that
fits the caches (3072 x 576: SmolLM2's gate_up) measures the kernel's compute; one several times the L3
(196608 x 576, 68 MiB of q4_1) measures it streaming from memory (k-quants take 512 inputs), where one core's bandwidth bounds
a single token (the GB/s column). Medians of --repeats, each a whole pass over the rows, the passes of
every configuration interleaved so a noisy neighbour slows them all alike; the machine's load average is
printed. The lowering (vpmaddwd on AVX2, plain vector IR elsewhere) is as numba targets this CPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from engine.backends.cpu.int8_matvec import _part_rows, quantize_act  # noqa: E402
from engine.backends.cpu.int8_repack import HALF_SCALE_TYPES, repack  # noqa: E402
from engine.backends.cpu.simd_dot import simd_enabled  # noqa: E402
from engine.units import MIB  # noqa: E402
from tests.support.quant_rows import random_rows  # noqa: E402

_BASE_ROWS = 4096  # random rows made once per type, tiled to the larger shapes
_SUPER_BLOCK_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="q4_1,q8_0,q6_k")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--shapes", default="3072x576,196608x576")
    ap.add_argument("--repeats", type=int, default=7)
    return ap.parse_args()


def make_part(tensor_type: Q, n_out: int, n_in: int) -> tuple:
    base = random_rows(tensor_type, min(n_out, _BASE_ROWS), n_in)
    rows = np.tile(base, (-(-n_out // base.shape[0]), 1))[:n_out]
    return tuple(repack(tensor_type, rows, n_in, tensor_type in HALF_SCALE_TYPES))


def main() -> None:
    args = parse_args()
    types = [Q[t.strip().upper()] for t in args.types.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cases = []
    for tensor_type in types:
        for n_out, n_in in shapes:
            if tensor_type in _SUPER_BLOCK_TYPES:  # 256-weight super-blocks: the inputs rounded down
                n_in = max(256, n_in // 256 * 256)
            part = make_part(tensor_type, n_out, n_in)
            mib = sum(a.nbytes for a in part[1:]) / MIB
            for n_tok in tokens:
                x = np.random.default_rng(n_tok).standard_normal((n_tok, n_in)).astype(np.float32)
                act, y = quantize_act(x, np.float32(32767.0)), np.empty((n_tok, n_out), np.float32)
                _part_rows(part, 0, n_out, act, y, 0)  # compile / warm
                cases.append(((tensor_type.name.lower(), f"{n_out}x{n_in}", mib, n_tok), part, act, y, []))
    for _ in range(args.repeats):
        for _key, part, act, y, times in cases:
            t0 = time.perf_counter()
            _part_rows(part, 0, part[1].shape[0], act, y, 0)
            times.append(time.perf_counter() - t0)
    print(f"integer decode products, one thread; lowering: {'vpmaddwd (AVX2)' if simd_enabled() else 'vector IR'}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| type | rows x in | MiB | tokens | Gweights/s | weight GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, shape, mib, n_tok), part, _act, _y, times in cases:
        t = statistics.median(times)
        n_out, n_in = (int(v) for v in shape.split("x"))
        print(f"| {name} | {shape} | {mib:.0f} | {n_tok} | {n_out * n_in * n_tok / t / 1e9:.1f} | "
              f"{mib * MIB / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
