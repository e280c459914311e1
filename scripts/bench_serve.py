"""Benchmark of the HTTP server: time to first token and aggregate decode tok/s at 1, 2, 4, 8 streams.

    .venv/bin/python scripts/bench_serve.py [--model smollm2] [--max-tokens 64] [--threads 2]
                                            [--cpu-weights quantized,f32]

Starts the real server in-process (uvicorn + uvloop + engine loop) on a free port with --batch 8, then
for each concurrency N sends N streaming chat requests at once (distinct prompts, greedy, ignore_eos so
every stream decodes exactly --max-tokens tokens) and reports, as a markdown table:
- TTFT: median over the N streams of request sent -> first content chunk;
- aggregate decode tok/s: all streams' tokens after their first / (last finish - first first-token).
- peak RSS of the server process (each --cpu-weights value runs in a fresh process, one after the other).
The load average is printed; the machine is shared, so compare ratios within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import orjson  # noqa: E402
from engine.cpu_threads import limit_threads  # noqa: E402
from engine.loader import open_model  # noqa: E402
from tests.support.server_harness import running_server  # noqa: E402

TOPICS = ["the sea", "a city at night", "mountains", "an old library", "the desert", "a forest", "winter", "trains"]


async def one_stream(client: httpx.AsyncClient, url: str, topic: str, max_tokens: int,
                     model: str = "smollm2") -> tuple[float, float, float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
            "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                tokens += 1
                first = first or time.perf_counter()
    return sent, first, time.perf_counter(), tokens


async def run_level(url: str, n: int, max_tokens: int, model: str = "smollm2") -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*[one_stream(client, url, TOPICS[i], max_tokens, model) for i in range(n)])
    ttft = statistics.median(first - sent for sent, first, _, _ in results)
    decode_tokens = sum(tokens - 1 for *_, tokens in results)
    span = max(end for _, _, end, _ in results) - min(first for _, first, _, _ in results)
    return {"streams": n, "ttft_ms": ttft * 1e3, "decode_tok_s": decode_tokens / span}


def measure(args) -> dict:
    """Rows of every concurrency level and the peak RSS, for one --cpu-weights value in this process."""
    limit_threads(args.threads)
    loaded = open_model(args.model, max_positions=1024, cpu_weights=args.cpu_weights)
    rows = []
    with running_server(loaded, batch=8, ctx_size=1024, threads=args.threads, cpu_weights=args.cpu_weights) as (url, _):
        asyncio.run(run_level(url, 1, 8))  # warm-up
        for n in (int(x) for x in args.levels.split(",")):
            rows.append(asyncio.run(run_level(url, n, args.max_tokens)))
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rows": rows, "rss_mib": rss_mib, "model": loaded.path.name, "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--cpu-weights", default="quantized,f32", help="comma-separated: quantized, f32")
    ap.add_argument("--json", action="store_true", help="print the result as JSON (used for the comparison)")
    args = ap.parse_args()
    values = [v.strip() for v in args.cpu_weights.split(",") if v.strip()]
    if len(values) == 1:
        result = measure(args)
        if args.json:
            print(json.dumps(result))
            return 0
        results = {values[0]: result}
    else:
        results = {}
        for value in values:
            cmd = [sys.executable, __file__, "--json", "--cpu-weights", value, "--model", args.model,
                   "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "--levels", args.levels]
            results[value] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    first = next(iter(results.values()))
    print(f"model {first['model']}, threads {args.threads}, {args.max_tokens} tokens per stream, load average "
          + ", ".join(f"{v} {r['load']:.2f}" for v, r in results.items()))
    print("| cpu-weights | streams | TTFT median (ms) | aggregate decode (tok/s) | vs 1 stream | peak RSS (MiB) |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for value, result in results.items():
        base = result["rows"][0]["decode_tok_s"]
        for r in result["rows"]:
            print(f"| {value} | {r['streams']} | {r['ttft_ms']:.0f} | {r['decode_tok_s']:.1f} | "
                  f"{r['decode_tok_s'] / base:.2f}x | {result['rss_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
