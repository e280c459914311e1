"""Benchmark of the HTTP server: time to first token and aggregate decode tok/s at 1, 2, 4, 8 streams.

    .venv/bin/python scripts/bench_serve.py [--model smollm2] [--max-tokens 64] [--threads 2]

Starts the real server in-process (uvicorn + uvloop + engine loop) on a free port with --batch 8, then
for each concurrency N sends N streaming chat requests at once (distinct prompts, greedy, ignore_eos so
every stream decodes exactly --max-tokens tokens) and reports, as a markdown table:
- TTFT: median over the N streams of request sent -> first content chunk;
- aggregate decode tok/s: all streams' tokens after their first / (last finish - first first-token).
The load average is printed; the machine is shared, so compare ratios within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import orjson  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from engine.loader import open_model  # noqa: E402
from tests.server_harness import running_server  # noqa: E402

TOPICS = ["the sea", "a city at night", "mountains", "an old library", "the desert", "a forest", "winter", "trains"]


async def one_stream(client: httpx.AsyncClient, url: str, topic: str, max_tokens: int) -> tuple[float, float, float, int]:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
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


async def run_level(url: str, n: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*[one_stream(client, url, TOPICS[i], max_tokens) for i in range(n)])
    ttft = statistics.median(first - sent for sent, first, _, _ in results)
    decode_tokens = sum(tokens - 1 for *_, tokens in results)
    span = max(end for _, _, end, _ in results) - min(first for _, first, _, _ in results)
    return {"streams": n, "ttft_ms": ttft * 1e3, "decode_tok_s": decode_tokens / span}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--levels", default="1,2,4,8")
    args = ap.parse_args()
    threadpool_limits(limits=args.threads, user_api="blas")
    loaded = open_model(args.model, max_positions=1024)
    rows = []
    with running_server(loaded, batch=8, ctx_size=1024, threads=args.threads) as (url, _):
        asyncio.run(run_level(url, 1, 8))  # warm-up
        for n in (int(x) for x in args.levels.split(",")):
            rows.append(asyncio.run(run_level(url, n, args.max_tokens)))
    base = rows[0]["decode_tok_s"]
    print(f"model {loaded.path.name}, BLAS threads {args.threads}, {args.max_tokens} tokens per stream, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| streams | TTFT median (ms) | aggregate decode (tok/s) | vs 1 stream |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['streams']} | {r['ttft_ms']:.0f} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
