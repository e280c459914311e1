"""Prefill at depth, strata against llama-server: tok/s of a fresh prompt of 2K / 8K / 16K tokens, and peak RSS.

    .venv/bin/python scripts/bench_prefill.py [--model qwen2.5-coder-0.5b] [--depths 2048,8192,16384]
        [--repeats 3] [--threads 2] [--port 8200] [--strata after=. --strata before=/work/main]
        [--llama-server PATH]

Each server runs as its own process, one after the other, at 32K context (llama-server
`-t T -tb T -c 32768 --jinja`; strata `serve --threads T --ctx-size 32768`); --strata LABEL=CHECKOUT runs that
checkout's .venv/bin/strata (so an older commit is measured in the same run). A request is a streamed
/v1/completions of exactly `depth` token ids (random ids from the ordinary vocabulary, a new draw every
request: no prefix cache can serve it) and max_tokens 1; prefill tok/s = depth / time to the first token.
Printed: medians over --repeats per depth (and the spread), peak RSS (VmHWM) of each server after its
requests, and the load average. The machine is shared: compare columns within one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CTX = 32768
WORDS = (1000, 100000)  # token ids drawn from here: ordinary pieces on the models we ship, no specials


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--depths", default="2048,8192,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--strata", action="append", default=[], metavar="LABEL=CHECKOUT",
                    help="a strata checkout with its own .venv (default: this one, labelled strata)")
    ap.add_argument("--llama-server", default=str(Path.home() / ".cache/llama-server-peer/llama.cpp/build/bin/"
                                                                  "llama-server"), help="'' to skip it")
    return ap.parse_args()


def model_path(name: str) -> str:
    sys.path.insert(0, str(ROOT))
    from engine.model_store import resolve_model

    return str(resolve_model(name, fetch=False))


def commands(args) -> list[tuple[str, list[str], Path]]:
    """(label, argv, working directory) per server."""
    t = str(args.threads)
    out = []
    for spec in args.strata or [f"strata={ROOT}"]:
        label, checkout = spec.split("=", 1)
        checkout = Path(checkout).resolve()
        out.append((label, [str(checkout / ".venv/bin/strata"), "serve", "--model", args.model, "--port",
                            str(args.port), "--threads", t, "--ctx-size", str(CTX)], checkout))
    if args.llama_server:
        out.append(("llama-server", [args.llama_server, "-m", model_path(args.model), "--port", str(args.port),
                                     "-t", t, "-tb", t, "-c", str(CTX), "--jinja"], ROOT))
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server did not become ready")


def prefill_seconds(url: str, model: str, ids: list[int]) -> float:
    """Seconds from sending the prompt to the first streamed token."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - sent
    raise RuntimeError("no token streamed")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_server(label, argv, cwd, args, depths, rng) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    env = dict(os.environ, PYTHONPATH=str(cwd))
    log = open(f"/tmp/bench_prefill_{label}.log", "w")
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        prefill_seconds(url, args.model, rng.integers(*WORDS, 64).tolist())  # warm-up
        rates = {}
        for depth in depths:
            rates[depth] = [depth / prefill_seconds(url, args.model, rng.integers(*WORDS, depth).tolist())
                            for _ in range(args.repeats)]
            print(f"  {label} {depth}: " + " ".join(f"{r:.1f}" for r in rates[depth]) + " tok/s", flush=True)
        return {"rates": rates, "rss": peak_rss_mib(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def main() -> int:
    args = parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rng = np.random.default_rng(int(time.time()))
    results = {}
    for label, argv, cwd in commands(args):
        print(f"{label}: {' '.join(argv)}", flush=True)
        results[label] = run_server(label, argv, cwd, args, depths, rng)
    labels = list(results)
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (after the runs); "
          f"{os.cpu_count()} CPUs; medians of {args.repeats} (min-max)")
    print("| prefill (tok/s) | " + " | ".join(labels) + " |\n| --- |" + " ---: |" * len(labels))
    for depth in depths:
        cells = [results[k]["rates"][depth] for k in labels]
        print(f"| {depth} tokens | " + " | ".join(f"{statistics.median(c):.1f} ({min(c):.0f}-{max(c):.0f})"
                                                  for c in cells) + " |")
    print("| peak RSS (MiB) | " + " | ".join(f"{results[k]['rss']:.0f}" for k in labels) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
