"""Benchmark of the conversation cache: replays agent-style workloads against the server and prints, per
workload, prompt tokens, computed tokens, the ideal, their ratio and difference, full re-reads and time to
first token.

    .venv/bin/python scripts/bench_cache.py [--turns 6] [--pressure [--pressure-ctx TOKENS]]
        [--model smollm2|tiny-lfm2|tiny-qwen3next|tiny-qwen3moe|gemma3-270m|PATH] [--temperature 1.0]
        [--only "two alternating,trimmed history"|"tool loop"] [--chat-template FILE] [--keep-reply-tokens off]

Workloads (SmolLM2, greedy unless --temperature, 16-token replies): two conversations alternating; one
conversation with a short unrelated request between turns; a head that toggles between two tool lists; four
conversations rotating through two slots. `ideal` = prompt tokens not shared with any earlier prompt + reply of
the run, + 1 per request, where a prompt's ids are the server's (replies it generated kept as generated,
--keep-reply-tokens) and a reply's are the ids the next prompt carries for it. With --pressure the device
pool holds one slot's worth (its context: at least 320 tokens,
more when the workload's longest request needs it, found by rendering the workload with placeholder replies
first, or --pressure-ctx; 320 gives SmolLM2 20 blocks), the host tier a quarter of that, and a disk tier the
rest: turns park the other conversations in host RAM, the host tier spills to disk, and hits restore them.
A "full re-read" is a request (after the first of its conversation) that reused under 10% of its prompt;
"earlier turns recomputed": the tokens of an earlier request (prompt and reply) that a later prompt carries
whole and computed again (a reply's last token, sampled and never fed back, not counted).
Two more workloads: a history trimmed to its system message and last exchange every turn, and a fan-out of
questions over one shared context. `--model tiny-lfm2` runs them on a seeded tiny random lfm2 (hybrid:
short convs + attention, tests/support/tiny_lfm2.py) whose head only emits digits, capitals and punctuation when
greedy; `--model tiny-qwen3next` the same on a seeded tiny random qwen3next (gated DeltaNet + gated attention
+ MoE, tests/support/tiny_qwen3next.py); `--model tiny-qwen3moe` a seeded tiny random qwen3moe over the whole tiny
vocabulary (byte tokens whose text re-encodes merged). `--only "tool loop"` (not in the default set): one
agent loop whose every turn must call a tool (the format's grammar) and gets its result, the call sent back as
`tool_calls`; SmolLM2 runs the generic format, `--chat-template tests/data/hermes_tools_template.jinja` hermes.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.config import ServerConfig  # noqa: E402
from api.serve import build_state  # noqa: E402
from engine.kv import BLOCK_SIZE, blocks_needed, layout_for, resolve_kv_type  # noqa: E402
from engine.chat_template import ChatTemplate  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.units import MIB  # noqa: E402
from scripts.bench_cache_workloads import (  # noqa: E402
    EXTRA_WORKLOADS, WORKLOADS, DryReplayer, Replayer)
from tests.support.server_harness import running_server  # noqa: E402

PRESSURE_MIN_CTX = 320  # the pressure runs' context so far (SmolLM2: a 20-block pool)

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
    block_mib = layout_for(loaded.model.config, 1, BLOCK_SIZE, kv_type).bytes_per_block / MIB
    # + half a block: the server floors MiB to whole blocks
    return dict(ctx_size=blocks * BLOCK_SIZE, kv_cache_mib=str((blocks + 0.5) * block_mib),
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


TINY_LFM2_OUTPUT = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?:;"


def load_bench_model(name: str, tmp: str, chat_template: str | None = None):
    """smollm2 (the store), `tiny-lfm2` / `tiny-qwen3next` / `tiny-qwen3moe` (written to tmp), or a GGUF path;
    `chat_template`: a jinja file in place of the model's template."""
    loaded = _load_bench_model(name, tmp)
    if chat_template is None:
        return loaded
    return dataclasses.replace(loaded, chat_template=ChatTemplate(Path(chat_template).read_text(),
                                                                  f"file:{chat_template}"))


def _load_bench_model(name: str, tmp: str):
    if name == "tiny-qwen3moe":  # random weights, the whole tiny vocabulary (byte tokens that merge on re-encoding)
        from tests.support.tiny_moe_gguf import write_tiny_moe_gguf

        path = Path(tmp) / f"{name}.gguf"
        write_tiny_moe_gguf(path, "qwen3moe", seed=5, n_ctx=4096)
        return open_model(str(path), max_positions=4096)
    if name not in ("tiny-lfm2", "tiny-qwen3next"):
        return open_model(name, max_positions=2048)
    from tests.support.tiny_gguf import tiny_vocab
    from tests.support.tiny_lfm2 import write_tiny_lfm2
    from tests.support.tiny_qwen3next import write_tiny_qwen3next

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
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, tiny-lfm2, tiny-qwen3next, tiny-qwen3moe, gemma3-270m or a GGUF path")
    ap.add_argument("--chat-template", default=None, help="a jinja file in place of the model's chat template "
                    "(tests/data/hermes_tools_template.jinja: the hermes tool format on SmolLM2)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (seeded per request)")
    ap.add_argument("--keep-reply-tokens", default="on", choices=("on", "off"), help="see strata serve")
    ap.add_argument("--state-checkpoint-every", default="auto", help="hybrid models: N blocks or auto, see strata serve")
    ap.add_argument("--per-request", action="store_true", help="print each request's computed vs ideal")
    ap.add_argument("--only", default="", help="comma-separated workload names to run (default: all)")
    args = ap.parse_args()
    model_dir = tempfile.TemporaryDirectory()
    loaded = load_bench_model(args.model, model_dir.name, args.chat_template)
    print(f"recompute for comparison: one 16-token block costs {recompute_ms_per_block(loaded):.1f} ms of prefill")
    series = {}
    print(f"| workload{' (pressure)' if args.pressure else ''} | requests | prompt tokens | computed | ideal | "
          "computed / ideal | excess | earlier turns recomputed | full re-reads | TTFT median (ms) | tier moves |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    known = {**WORKLOADS, **EXTRA_WORKLOADS}
    wanted = [w.strip() for w in args.only.split(",") if w.strip()] or list(WORKLOADS)
    unknown = set(wanted) - set(known)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(known)}")
    for name in wanted:
        play = known[name]
        with tempfile.TemporaryDirectory() as disk_dir:
            extra = pressure_config(loaded, play, args.turns, args.pressure_ctx, disk_dir) \
                if args.pressure else dict(ctx_size=1024)
            extra.update(state_checkpoint_every=args.state_checkpoint_every, keep_reply_tokens=args.keep_reply_tokens)
            with running_server(loaded, batch=2, **extra) as (url, state):
                replayer = Replayer(url, loaded, state, args.temperature)
                play(replayer, args.turns)
                usage = state.engine.cache.usage()
        rows = replayer.rows
        if args.per_request:  # where a workload loses: computed - ideal per request
            for i, r in enumerate(rows):
                print(f"  {name} #{i}: prompt {r['prompt']}, shared with an earlier one {r['shared']}, "
                      f"computed {r['computed']}, ideal {r['ideal']}, excess {r['computed'] - r['ideal']}, "
                      f"of an earlier turn it carries whole {r['reply_recomputed']}")
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
        print(f"| {name} | {len(rows)} | {prompt} | {computed} | {ideal} | {computed / ideal:.3f} | {computed - ideal} | "
              f"{sum(r['reply_recomputed'] for r in rows)} | "
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
