"""numpy tok/s of a small random-weight MoE: prefill and batched decode, for several expert counts; with
--expert-cache, the CUDA expert cache's behaviour on the kernel emulator instead.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_moe.py [--arch qwen3moe] [--experts 16,64]
        [--top-k 4] [--weights f32,quantized] [--expert-quant Q8_0|MXFP4|F16] [--repeats 3] [--threads 1]
    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_moe.py --expert-cache [--cache-fractions 0.25,0.5,1]

--expert-cache: a tiny gpt-oss (4 layers, 16 experts, top-2, Q8_0 experts) on tests/support/fake_cuda_emulated.py (the
real kernel sources under g++), two workloads: "hot set" (router bias +4 on experts 0..3 of each layer: 16 of
the 64 experts take nearly every token) and "uniform" (no bias). For each cache size (a fraction of all 64
experts) one 24-token prefill then 16 greedy decode steps; per decode token: expert uses, hits, loads and
bytes copied host -> device; and whether the tokens equal the numpy backend's. The emulator times nothing
meaningful (its copies are memmoves, its events report 1 us): only counts. A GPU section (decode tok/s of a
Qwen3-30B-A3B-shaped model at 25/50/100% of the experts) is not written: no GPU here.

The model is written by tests/support/tiny_moe_gguf.py into a temporary directory: d=256, 4 layers, 8/2 heads of
32, experts of F=128 (--expert-quant blocks, Q8_0 elsewhere, for --weights quantized; else F32). Decode at batch B runs B sequences
of 64 context tokens through one batched step per token. "experts/layer" is the mean number of distinct
experts a decode step at that batch runs per layer (the grouped FFN runs one product pair per expert that
got tokens). With the same top-k, a token's cost should not depend on the number of experts: compare
the rows of one --top-k across --experts. Medians over repeats; the load average is printed beside.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.reference import moe as numpy_moe  # noqa: E402
from engine.cpu_threads import limit_threads  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.sequence import ModelRunner, Sequence  # noqa: E402
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf  # noqa: E402

SHAPE = dict(n_embd=256, n_layer=4, n_head=8, n_head_kv=2, head_dim=32, n_ff_exp=128, n_ctx=1024)
BATCHES = (1, 4, 16)


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt) % 270 + 3 for i in range(n)]


def bench_prefill(runner: ModelRunner, n_tokens: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        seq = Sequence(_prompt(n_tokens, r))
        runner.ensure_blocks(seq, n_tokens)
        t0 = time.perf_counter()
        runner.step([(seq, n_tokens)])
        times.append(time.perf_counter() - t0)
        runner.release(seq)
    return n_tokens / statistics.median(times)


def bench_decode(runner: ModelRunner, batch: int, steps: int, repeats: int, context: int = 64) -> tuple[float, float]:
    """(tok/s, mean distinct experts per layer and step)."""
    rates, hits = [], []
    real = numpy_moe.expert_ffn

    def counting(backend, h, moe, ids, weights, activation):
        hits.append(len(set(ids.ravel().tolist())))
        return real(backend, h, moe, ids, weights, activation)

    for r in range(repeats):
        seqs = [Sequence(_prompt(context, 31 * b + r)) for b in range(batch)]
        for seq in seqs:
            runner.ensure_blocks(seq, context + steps)
        runner.step([(s, context) for s in seqs])
        hits.clear()
        numpy_moe.expert_ffn = counting
        t0 = time.perf_counter()
        for step in range(steps):
            for s in seqs:
                s.token_ids.append(_prompt(1, step + s.token_ids[0])[0])
            runner.step([(s, 1) for s in seqs])
        rates.append(batch * steps / (time.perf_counter() - t0))
        numpy_moe.expert_ffn = real
        for s in seqs:
            runner.release(s)
    return statistics.median(rates), statistics.mean(hits)


def run(arch: str, n_experts: int, top_k: int, weights: str, repeats: int, directory: str,
        expert_quant: str = "Q8_0") -> list[str]:
    path = os.path.join(directory, f"{arch}-{n_experts}-{weights}.gguf")
    quant = {"quant": "Q8_0", "expert_quant": expert_quant} if weights == "quantized" else {}
    write_tiny_moe_gguf(path, arch, seed=1, n_expert=n_experts, n_expert_used=top_k, **SHAPE, **quant)
    loaded = open_model(path, fetch=False, backend_name="numpy", cpu_weights=weights)
    runner = ModelRunner(loaded.model, num_blocks=256, block_size=16)
    bench_prefill(runner, 16, 1)  # warm-up (numba kernels, BLAS)
    label = f"quantized ({expert_quant} experts)" if weights == "quantized" else weights
    row = [arch, str(n_experts), str(top_k), label, f"{bench_prefill(runner, 256, repeats):.0f}"]
    for batch in BATCHES:
        rate, hit = bench_decode(runner, batch, 16, repeats)
        row.append(f"{rate:.0f} ({hit:.1f})")
    return row


CACHE_SHAPE = dict(n_layer=4, n_expert=16, n_expert_used=2, expert_quant="Q8_0", router_scale=0.3, weight_scale=0.1)


def _greedy_on(model, prompt: list[int], steps: int, on_prefill_done=lambda: None) -> list[int]:
    import numpy as np

    runner = ModelRunner(model, num_blocks=8, block_size=16)
    seq = Sequence(list(prompt))
    runner.ensure_blocks(seq, len(prompt) + steps)
    logits = runner.step([(seq, len(prompt))])
    on_prefill_done()
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits[-1])))
        seq.token_ids.append(out[-1])
        logits = runner.step([(seq, 1)])
    return out


def bench_expert_cache(fractions: list[float], steps: int = 16) -> None:
    """Hits, loads and bytes per decode token of the CUDA expert cache on the emulator (see the docstring)."""
    import pytest

    from engine.backends.cuda.expert_cache.setup import configure_expert_cache
    from engine.backends.reference.backend import NumpyBackend
    from engine.model import load_model
    from tests.support import fake_cuda_emulated

    print("| workload | slots (of 64) | decode expert uses/token | hits/token | loads/token | KiB moved/token | "
          "hit rate | prefill loads | tokens == numpy |")
    print("|---|---|---|---|---|---|---|---|---|")
    prompt = _prompt(24, 5)
    with tempfile.TemporaryDirectory() as directory, pytest.MonkeyPatch.context() as mp:
        fake_cuda_emulated.install(mp, Path(directory))
        from engine.backends.cuda.backend import CudaBackend

        for workload, hot in (("hot set (4 of 16 per layer)", 4), ("uniform", 0)):
            path = Path(directory) / f"m{hot}.gguf"
            write_tiny_moe_gguf(path, "gpt-oss", seed=4, hot_experts=hot, **CACHE_SHAPE)
            expected = _greedy_on(load_model(path, NumpyBackend())[0], prompt, steps)
            for fraction in fractions:
                backend = CudaBackend(graphs=False)
                cache = configure_expert_cache(backend, "auto")
                cache.request_resize(max(1, round(fraction * 64)))
                after_prefill = {}
                tokens = _greedy_on(load_model(path, backend)[0], prompt, steps,
                                    lambda: after_prefill.update(cache.stats()))
                s, p = cache.stats(), after_prefill
                hits = s["expert_cache_hits"] - p["expert_cache_hits"]
                loads = s["expert_cache_loads"] - p["expert_cache_loads"]
                moved = (s["expert_cache_loaded_bytes"] - p["expert_cache_loaded_bytes"]) / 1024
                print(f"| {workload} | {cache.num_slots} | {(hits + loads) / steps:.1f} | {hits / steps:.1f} | "
                      f"{loads / steps:.1f} | {moved / steps:.1f} | {hits / max(1, hits + loads):.0%} | "
                      f"{p['expert_cache_loads']} | {tokens == expected} |", flush=True)
                backend.close()
    print(f"\nshape {CACHE_SHAPE}, prompt 24 tokens, {steps} decode steps; slot = one expert's gate+up+down")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen3moe", choices=("qwen3moe", "gpt-oss"))
    parser.add_argument("--experts", default="16,64")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--weights", default="f32,quantized")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--expert-quant", default="Q8_0", choices=("Q8_0", "MXFP4", "F16"),
                        help="expert tensors' type with --weights quantized (attention and head: Q8_0)")
    parser.add_argument("--expert-cache", action="store_true", help="the CUDA expert cache on the kernel emulator")
    parser.add_argument("--cache-fractions", default="0.25,0.5,1", help="cache sizes as fractions of all experts")
    args = parser.parse_args()
    limit_threads(args.threads)
    if args.expert_cache:
        bench_expert_cache([float(f) for f in args.cache_fractions.split(",")])
        return 0
    header = ["arch", "experts", "top-k", "weights", "prefill 256 tok/s"]
    header += [f"decode B={b} tok/s (experts/layer)" for b in BATCHES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as directory:
        for n_experts in (int(e) for e in args.experts.split(",")):
            for weights in args.weights.split(","):
                print("| " + " | ".join(run(args.arch, n_experts, args.top_k, weights, args.repeats, directory,
                                                 args.expert_quant)) + " |",
                      flush=True)
    print(f"\nthreads {args.threads}, load average {os.getloadavg()[0]:.2f}, shape {SHAPE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
