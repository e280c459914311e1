"""Benchmark of the pipeline: 1 vs 2 stages with 1, 2 and 4 batch groups, four concurrent streams.

    .venv/bin/python scripts/bench_pipeline.py [--model smollm2] [--max-tokens 48] [--split 15] [--repeats 3]

Runs the engine loop in-process (no HTTP, so only the engine and its stages are measured) on the model with
--batch 4: four requests with distinct ~100-token prompts arrive at once, greedy, ignore_eos, and every one
decodes --max-tokens tokens. Per configuration (stages, groups, BLAS threads per stage) it prints:
- TTFT: median over the four streams of submit -> first token;
- aggregate decode tok/s: tokens after each stream's first / (last finish - first first-token);
- per-stage busy share: each stage's compute seconds / wall seconds of the run (1.0 = never idle);
- overlap: sum of stage busy seconds / wall seconds (1.0 = no two stages ever computed at once).
Each configuration runs --repeats times and the median row is kept; the load average is printed, since
the machine is shared: compare ratios within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from threadpoolctl import threadpool_limits  # noqa: E402

from engine.loader import open_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.sequence import ModelRunner, Sequence  # noqa: E402
from scheduler.engine_loop import EngineLoop  # noqa: E402
from scheduler.request import Request  # noqa: E402

STREAMS = 4


def prompts(tokenizer, n: int) -> list[list[int]]:
    topics = ["the sea", "a city at night", "mountains", "an old library"]
    out = []
    for topic in topics[:n]:
        text = f"Write a long story about {topic}. " * 12
        out.append(tokenizer.encode(text, add_special=True)[:100])
    return out


async def run_once(loaded, split: tuple[int, ...], groups: int, max_tokens: int) -> dict:
    runner = ModelRunner(loaded.model, 4 * 64, 16, layer_split=split)
    loop = EngineLoop(runner, loaded.tokenizer, num_slots=STREAMS, prefill_chunk=512, max_queue=16,
                      batch_groups=groups)
    loop.start()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def stream(i: int, prompt: list[int]):
        sent, first, tokens = time.perf_counter(), None, 0
        async for delta in loop.submit(Request(f"b{i}", prompt, params)):
            if delta.token_ids:
                tokens += len(delta.token_ids)
                first = first or time.perf_counter()
        return sent, first, time.perf_counter(), tokens

    started = time.perf_counter()
    results = await asyncio.gather(*[stream(i, p) for i, p in enumerate(prompts(loaded.tokenizer, STREAMS))])
    wall = time.perf_counter() - started
    stages = loop.pipeline.snapshot()
    busy = [s["busy_seconds"] for s in stages]
    await loop.shutdown(1)
    span = max(end for _, _, end, _ in results) - min(first for _, first, _, _ in results)
    return {
        "ttft_ms": statistics.median(first - sent for sent, first, _, _ in results) * 1e3,
        "decode_tok_s": sum(t - 1 for *_, t in results) / span,
        "busy": [b / wall for b in busy],
        "ms_per_job": [s["busy_seconds"] / max(s["jobs"], 1) * 1e3 for s in stages],
        "overlap": sum(busy) / wall,
    }


def thread_scaling(loaded, cut: int, steps: int = 20) -> dict:
    """What two stage workers can gain on this machine, without the engine: the ms of one 2-row decode step
    through stage 0's layers alone, and the same step in two threads at once (each on its own runner and
    sequences), with 1 BLAS thread. A speedup near 2 means numpy releases the GIL and the cores are free."""
    def make():
        runner = ModelRunner(loaded.model, 64, 16, layer_split=(cut,))
        seqs = [Sequence(list(range(10, 110))) for _ in range(2)]
        for seq in seqs:
            runner.ensure_blocks(seq, 100 + 2 * steps)  # pairs[0] decodes in both timings
        batch_seqs = [(seq, 100) for seq in seqs]
        runner.run_stage(runner.stages[0], runner.prepare(batch_seqs), None)
        runner.commit(batch_seqs)
        return runner, seqs

    def decode(runner, seqs):
        for _ in range(steps):
            for seq in seqs:
                seq.token_ids.append(5)
            work = [(seq, 1) for seq in seqs]
            runner.run_stage(runner.stages[0], runner.prepare(work), None)
            runner.commit(work)

    pairs = [make(), make()]

    def timed(n: int) -> float:
        threads = [threading.Thread(target=decode, args=pairs[i]) for i in range(n)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (time.perf_counter() - started) / steps * 1e3

    with threadpool_limits(limits=1, user_api="blas"):
        alone, together = timed(1), timed(2)
    return {"alone_ms": alone, "together_ms": together, "speedup": 2 * alone / together}


def balanced_cut(model) -> int:
    """The first layer of stage 1 that best balances weight bytes between two stages; the output head
    (vocab x d, a fifth of SmolLM2-135M) counts on the last stage."""
    w = model.weights
    layer_bytes = [sum(getattr(v, "nbytes", 0) for v in vars(layer).values() if v is not None) for layer in w.layers]
    head = w.output.nbytes
    total = sum(layer_bytes) + head
    return min(range(1, len(layer_bytes)), key=lambda c: abs(2 * sum(layer_bytes[:c]) - total))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--split", type=int, default=None,
                        help="first layer of stage 1 (default: the cut that balances weight bytes, head included)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loaded = open_model(args.model, max_positions=1024)
    cut = args.split or balanced_cut(loaded.model)
    cores = os.cpu_count() or 1
    configs = [((), g, cores) for g in (1, 2, 4)] + [((), 1, 1)] + [((cut,), g, max(1, cores // 2)) for g in (1, 2, 4)]
    print(f"model {loaded.path.name}, {loaded.model.config.n_layers} layers, 2 stages cut at layer {cut}, "
          f"{STREAMS} streams x {args.max_tokens} tokens; {cores} cores; load average {os.getloadavg()[0]:.2f}")
    print("\n| stages | groups | BLAS threads/stage | TTFT ms | decode tok/s | stage busy share | ms per job | overlap |")
    print("| ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for split, groups, threads in configs:
        runs = []
        with threadpool_limits(limits=threads, user_api="blas"):
            for _ in range(args.repeats):
                runs.append(asyncio.run(run_once(loaded, split, groups, args.max_tokens)))
        row = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]
        busy = " / ".join(f"{b:.2f}" for b in row["busy"])
        per_job = " / ".join(f"{m:.1f}" for m in row["ms_per_job"])
        print(f"| {len(split) + 1} | {groups} | {threads} | {row['ttft_ms']:.0f} | {row['decode_tok_s']:.1f} | "
              f"{busy} | {per_job} | {row['overlap']:.2f} |", flush=True)
    scaling = thread_scaling(loaded, cut)
    print(f"\nstage 0 (layers 0-{cut - 1}), one 2-row decode step, 1 BLAS thread: {scaling['alone_ms']:.1f} ms alone, "
          f"{scaling['together_ms']:.1f} ms with a second thread doing the same at once "
          f"(two threads give {scaling['speedup']:.2f}x the work per second)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
