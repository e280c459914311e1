"""Benchmark of the conversation cache: replays agent-style workloads against the server and prints, per
workload, prompt tokens, computed tokens, the ideal, their ratio, full re-reads and time to first token.

    .venv/bin/python scripts/bench_cache.py [--turns 6] [--pressure [--pressure-ctx TOKENS]]
        [--model smollm2|tiny-lfm2|tiny-qwen3next|gemma3-270m|PATH] [--only "two alternating,trimmed history"]

Workloads (SmolLM2, greedy, 16-token replies): two conversations alternating; one conversation with a
short unrelated request between turns; a head that toggles between two tool lists; four conversations
rotating through two slots. `ideal` = prompt tokens not shared with any earlier prompt + reply of the run,
+ 1 per request. With --pressure the device pool holds one slot's worth (its context: at least 320 tokens,
more when the workload's longest request needs it, found by rendering the workload with placeholder replies
first, or --pressure-ctx; 320 gives SmolLM2 20 blocks), the host tier a quarter of that, and a disk tier the
rest: turns park the other conversations in host RAM, the host tier spills to disk, and hits restore them.
A "full re-read" is a request (after the first of its conversation) that reused under 10% of its prompt.
Two more workloads: a history trimmed to its system message and last exchange every turn, and a fan-out of
questions over one shared context. `--model tiny-lfm2` runs them on a seeded tiny random lfm2 (hybrid:
short convs + attention, tests/tiny_lfm2.py) whose head only emits digits, capitals and punctuation, so a
reply's text re-encodes to the tokens it was generated as (random byte tokens would not); `--model
tiny-qwen3next` the same on a seeded tiny random qwen3next (gated DeltaNet + gated attention + MoE,
tests/tiny_qwen3next.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from api.chat_turn import ChatTurn, render_turn  # noqa: E402
from api.config import ServerConfig  # noqa: E402
from api.serve import build_state  # noqa: E402
from api.tool_specs import normalise_tools  # noqa: E402
from engine.kv import BLOCK_SIZE, blocks_needed, layout_for, resolve_kv_type  # noqa: E402
from engine.loader import encode_chat_prompt, open_model  # noqa: E402
from scheduler.cache_tree import common_prefix_len  # noqa: E402
from tests.server_harness import running_server  # noqa: E402

TOOLS = [[{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing", "parameters": {}}}
          for i in range(n)] for n in (3, 6)]
TOPICS = ["the history of Rome", "how plants make food", "the water cycle", "how engines work"]
REPLY_TOKENS = 16  # max_tokens of every request
PRESSURE_MIN_CTX = 320  # the pressure runs' context so far (SmolLM2: a 20-block pool)


class Replayer:
    def __init__(self, url, loaded, state):
        self.url, self.loaded, self.state, self.seen, self.rows = url, loaded, state, [], []

    def turn(self, messages, tools=None, first_of_conversation=False):
        body = {"model": self.state.served_name, "messages": messages, "temperature": 0, "max_tokens": REPLY_TOKENS,
                "stream": True, "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = tools
        started, ttft, text, usage = time.perf_counter(), None, [], None
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - started
                    text.append(chunk["choices"][0]["delta"]["content"])
        # The prompt as the server renders it (a template that does not render tools gets them described
        # in the system prompt by the generic tool format).
        turn = ChatTurn(messages, normalise_tools(tools))
        prompt = encode_chat_prompt(self.loaded.tokenizer, render_turn(self.state, turn))
        assert len(prompt) == usage["prompt_tokens"], "the bench renders another prompt than the server"
        shared = max((common_prefix_len(prompt, s) for s in self.seen), default=0)
        computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        self.rows.append({"prompt": usage["prompt_tokens"], "computed": computed,
                          "ideal": len(prompt) - shared + 1, "ttft": ttft or 0.0, "shared": shared,
                          "reread": not first_of_conversation and computed > 0.9 * usage["prompt_tokens"]})
        reply = "".join(text)
        self.seen.append(prompt + self.loaded.tokenizer.encode(reply, add_special=False))
        return reply


class DryReplayer:
    """Renders a workload's prompts without a server, each reply a placeholder of REPLY_TOKENS digits (one
    token each in SmolLM2's and the tiny lfm2's vocabularies), to find its longest request beforehand."""

    def __init__(self, loaded, state):
        self.loaded, self.state, self.longest = loaded, state, 0

    def turn(self, messages, tools=None, first_of_conversation=False):
        text = render_turn(self.state, ChatTurn(messages, normalise_tools(tools)))
        prompt = encode_chat_prompt(self.loaded.tokenizer, text)
        self.longest = max(self.longest, len(prompt) + REPLY_TOKENS)
        return "0" * REPLY_TOKENS


def pressure_config(loaded, play, turns: int, ctx_tokens: int, disk_dir: str) -> dict:
    """Server settings under pressure: a device pool of one slot (its context fits the workload's longest
    request, with a block to spare per turn for replies that re-encode longer), a host tier of a quarter
    of that, a disk tier. Sizes are whole blocks, given as (fractional) MiB."""
    if not ctx_tokens:
        state = build_state(ServerConfig(port=0, batch=1, ctx_size=2048, conversation_cache_mib=0), loaded)
        dry = DryReplayer(loaded, state)
        play(dry, turns)
        ctx_tokens = max(PRESSURE_MIN_CTX, dry.longest + BLOCK_SIZE * turns)
    blocks = blocks_needed(ctx_tokens, BLOCK_SIZE)
    kv_type = resolve_kv_type("auto", loaded.model.backend)
    block_mib = layout_for(loaded.model.config, 1, BLOCK_SIZE, kv_type).bytes_per_block / 2**20
    # + half a block: the server floors MiB to whole blocks
    return dict(ctx_size=blocks * BLOCK_SIZE, kv_cache_mib=(blocks + 0.5) * block_mib,
                conversation_cache_mib=(max(1, blocks // 4) + 0.5) * block_mib, conversation_cache_dir=disk_dir)


def recompute_ms_per_block(loaded, block_tokens: int = 16) -> float:
    """What recomputing one block's worth of prompt costs, measured inside a 512-token prefill."""
    from engine.sequence import ModelRunner, Sequence

    runner = ModelRunner(loaded.model, 64, 16)
    seq = Sequence(list(range(100, 612)))
    runner.ensure_blocks(seq, 512)
    started = time.perf_counter()
    runner.step([(seq, 512)])
    return (time.perf_counter() - started) * 1e3 * block_tokens / 512


def trimmed_turns(replayer, turns):
    """One conversation whose history is cut to the system message and the last exchange every turn."""
    history = [{"role": "system", "content": "You are a terse assistant. " * 4},
               {"role": "user", "content": f"Tell me about {TOPICS[0]}."}]
    for t in range(turns):
        reply = replayer.turn(history, first_of_conversation=t == 0)
        history = [history[0]] + history[-1:] + [{"role": "assistant", "content": reply},
                                                 {"role": "user", "content": f"Go on with part {t + 2}."}]


def fan_out_turns(replayer, turns):
    """One context (a long document and its summary), then one question over it per turn."""
    context = [{"role": "system", "content": "You answer questions about the document."},
               {"role": "user", "content": "Document: " + " ".join(TOPICS) * 3 + " Summarise it."}]
    summary = replayer.turn(context, first_of_conversation=True)
    context.append({"role": "assistant", "content": summary})
    for t in range(turns):
        replayer.turn(context + [{"role": "user", "content": f"Question {t}: what about {TOPICS[t % 4]}?"}])


def conversation_turns(replayer, names, turns, between=None, tools_for=None):
    history = {n: [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
               for i, n in enumerate(names)}
    for t in range(turns):
        for name in names:
            tools = tools_for(t) if tools_for else None
            reply = replayer.turn(history[name], tools, first_of_conversation=t == 0)
            history[name] += [{"role": "assistant", "content": reply},
                              {"role": "user", "content": f"Go on with part {t + 2}, in more detail."}]
            if between:
                replayer.turn([{"role": "user", "content": f"Quick: what is {t} plus {t}?"}],
                              first_of_conversation=True)


WORKLOADS = {
    "two alternating": lambda r, n: conversation_turns(r, ["a", "b"], n),
    "short request between turns": lambda r, n: conversation_turns(r, ["a"], n, between=True),
    "toggling tool list": lambda r, n: conversation_turns(r, ["a"], n, tools_for=lambda t: TOOLS[t % 2]),
    "4 conversations, 2 slots": lambda r, n: conversation_turns(r, ["a", "b", "c", "d"], n),
    "trimmed history": trimmed_turns,
    "fan-out over one context": fan_out_turns,
}
TINY_LFM2_OUTPUT = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?:;"


def load_bench_model(name: str, tmp: str):
    """smollm2 (the store), `tiny-lfm2` / `tiny-qwen3next` (written to tmp), or a GGUF path."""
    if name not in ("tiny-lfm2", "tiny-qwen3next"):
        return open_model(name, max_positions=2048)
    from tests.tiny_gguf import tiny_vocab
    from tests.tiny_lfm2 import write_tiny_lfm2
    from tests.tiny_qwen3next import write_tiny_qwen3next

    tokens = tiny_vocab()[0]
    byte_ids = {bytes([b]).decode("latin-1"): i for i, b in zip(range(3, 259), range(256))}
    output = [2] + [byte_ids[c] for c in TINY_LFM2_OUTPUT]  # EOS too: a reply may end early
    assert all(tokens[i] == c for c, i in zip(TINY_LFM2_OUTPUT, output[1:]))
    path = Path(tmp) / f"{name}.gguf"
    writer = write_tiny_lfm2 if name == "tiny-lfm2" else write_tiny_qwen3next
    writer(path, seed=5, n_ctx=4096, output_ids=output)
    return open_model(str(path), max_positions=4096)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--pressure", action="store_true")
    ap.add_argument("--pressure-ctx", type=int, default=0,
                    help="--pressure: the context (= device pool) in tokens (default: from each workload)")
    ap.add_argument("--plot", default=None, help="write an SVG of time to first token per request here")
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny-lfm2, tiny-qwen3next, gemma3-270m or a GGUF path")
    ap.add_argument("--state-checkpoint-every", default="auto", help="hybrid models: N blocks or auto, see strata serve")
    ap.add_argument("--per-request", action="store_true", help="print each request's computed vs ideal")
    ap.add_argument("--only", default="", help="comma-separated workload names to run (default: all)")
    args = ap.parse_args()
    model_dir = tempfile.TemporaryDirectory()
    loaded = load_bench_model(args.model, model_dir.name)
    print(f"recompute for comparison: one 16-token block costs {recompute_ms_per_block(loaded):.1f} ms of prefill")
    series = {}
    print(f"| workload{' (pressure)' if args.pressure else ''} | requests | prompt tokens | computed | ideal | "
          "computed / ideal | full re-reads | TTFT median (ms) | tier moves |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    wanted = [w.strip() for w in args.only.split(",") if w.strip()] or list(WORKLOADS)
    unknown = set(wanted) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    for name in wanted:
        play = WORKLOADS[name]
        with tempfile.TemporaryDirectory() as disk_dir:
            extra = pressure_config(loaded, play, args.turns, args.pressure_ctx, disk_dir) \
                if args.pressure else dict(ctx_size=1024)
            extra["state_checkpoint_every"] = args.state_checkpoint_every
            with running_server(loaded, batch=2, **extra) as (url, state):
                replayer = Replayer(url, loaded, state)
                play(replayer, args.turns)
                usage = state.engine.cache.usage()
        rows = replayer.rows
        if args.per_request:  # where a workload loses: computed - ideal per request
            for i, r in enumerate(rows):
                print(f"  {name} #{i}: prompt {r['prompt']}, shared with an earlier one {r['shared']}, "
                      f"computed {r['computed']}, ideal {r['ideal']}, excess {r['computed'] - r['ideal']}")
        series[name] = [(r["prompt"], r["ttft"] * 1e3, r["computed"]) for r in rows]
        prompt, computed, ideal = (sum(r[k] for r in rows) for k in ("prompt", "computed", "ideal"))
        ttft = statistics.median(r["ttft"] for r in rows) * 1e3
        tiers = f"{usage['parks']} parks, {usage['restores']} restores, {usage['spills']} spills, " \
                f"{usage['dropped_blocks']} dropped"
        if usage.get("state_windows"):  # lfm2: states recomputed from a window (engine/state_window.py)
            tiers += f", {usage['state_windows']} state windows"
        if args.per_request and "checkpoints_taken" in usage:
            tiers += "; checkpoints " + ", ".join(f"{k} {usage['checkpoints_' + k]}" for k in (
                "taken", "attached", "restored", "dropped", "device", "host", "disk"))
        if args.pressure:
            tiers = f"pool {usage['device_total']}, host {usage['host_total']} blocks; " + tiers
        moves = usage.get("moves", {})
        if moves:
            tiers += "; ms per block: " + ", ".join(
                f"{op} {m['seconds'] / m['count'] * 1e3:.2f}" for op, m in sorted(moves.items()) if m["count"])
        print(f"| {name} | {len(rows)} | {prompt} | {computed} | {ideal} | {computed / ideal:.2f} | "
              f"{sum(r['reread'] for r in rows)} | {ttft:.0f} | {tiers} |")
    if args.plot:
        Path(args.plot).write_text(svg_plot(series, "time to first token per request (ms) vs prompt tokens"))
    return 0


def svg_plot(series: dict[str, list[tuple[float, float, int]]], title: str) -> str:
    """A small dependency-free SVG: one polyline per workload, TTFT (y) against prompt tokens (x)."""
    width, height, pad = 720, 360, 50
    xs = [x for points in series.values() for x, _, _ in points] or [1]
    ys = [y for points in series.values() for _, y, _ in points] or [1]
    x_max, y_max = max(xs) * 1.05, max(ys) * 1.15
    sx = lambda x: pad + (width - 2 * pad) * x / x_max  # noqa: E731
    sy = lambda y: height - pad - (height - 2 * pad) * y / y_max  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
           f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>']
    for i in range(5):
        yv, xv = y_max * i / 4, x_max * i / 4
        out.append(f'<text x="{pad - 6}" y="{sy(yv) + 4:.0f}" text-anchor="end">{yv:.0f}</text>')
        out.append(f'<text x="{sx(xv):.0f}" y="{height - pad + 16}" text-anchor="middle">{xv:.0f}</text>')
    for k, (name, points) in enumerate(series.items()):
        color = colors[k % len(colors)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in sorted(points))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/>')
        out.append(f'<text x="{width - pad - 190}" y="{pad + 14 * k}" fill="{color}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
