"""Several strata replicas behind SGLang's router: how much each routing policy makes the replicas recompute.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_replicas.py [--replicas 3] [--turns 4]

Replicas (SmolLM2, numpy, one slot, a 512-token device pool, an 8 MiB host tier, a disk tier each) run in
this process on 127.0.0.1; the router (`sglang-router` 0.3.x, installed into .venv-router by
scripts/install_router.sh) runs beside them. Six conversations take turns in rotation (greedy, 8-token
replies, streamed, one request at a time). Each turn's body carries `prompt_cache_key` (so the replica names
the conversation); key routing also sends it as `X-SMG-Routing-Key`, the header the router's `manual` policy
keeps a key on one worker by. Policies: `round_robin`, `cache_aware` (the router's approximate prefix tree
over request text, its default; also with `--cache-threshold 0.7` instead of 0.3) and `manual` with the key.

`ideal` = prompt tokens not shared with the conversation's own previous prompt + reply, + 1 per request: what
the replica that kept the conversation must compute. A replica may compute less where conversations share a
prefix (SmolLM2's default system prompt), so a ratio can be under 1. A "full re-read" is a turn that reused
under half of its conversation's history (its previous prompt + reply): on a replica that never held the
conversation, it reuses only the prefix all conversations share.

Then, with key routing, the replica-loss sequence: replica 0 stops (its cache flushed to its disk tier),
every conversation takes a turn, replica 0 starts again on the same port and disk tier, every conversation
takes a turn; per phase, the conversations that moved and the replicas' "no replica held it" lines.
"""
from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from engine.loader import open_model  # noqa: E402
from scheduler.cache.tree import common_prefix_len  # noqa: E402
from tests.support.router_harness import Replica, healthy, router_python, running_router, wait_for_workers  # noqa: E402

TOPICS = ["the history of Rome", "how plants make food", "the water cycle", "how engines work",
          "why the sky is blue", "how bread rises"]
POLICIES = {"round_robin": ["--policy", "round_robin"], "cache_aware": ["--policy", "cache_aware"],
            # a new conversation matches only the prefix all share (under 70% of its text): placed on the
            # worker with the smallest tree, instead of on whichever holds the shared prefix
            "cache_aware 0.7": ["--policy", "cache_aware", "--cache-threshold", "0.7"],
            "key (manual)": ["--policy", "manual"]}
REPLICA_CONFIG = dict(batch=1, ctx_size=512, conversation_cache_mib=8, conversation_cache_disk_mib=256)


class MissLines(logging.Handler):
    """The replicas' "unseen" miss lines (scheduler/output.py), as (conversation, tokens from disk)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, int]] = []

    def emit(self, record):
        fields = getattr(record, "fields", {})
        if fields.get("miss") == "unseen":
            self.lines.append((fields["conversation"], fields["disk"]))


class Client:
    """Plays turns through the router and scores each against the ideal."""

    def __init__(self, url, loaded, send_key: bool):
        self.url, self.loaded, self.send_key = url, loaded, send_key
        self.seen: dict[str, list[int]] = {}  # per conversation: its last prompt + reply

    def turn(self, key: str, messages: list[dict]) -> dict:
        body = {"model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}, "prompt_cache_key": key}
        headers = {"X-SMG-Routing-Key": key} if self.send_key else {}
        started, ttft, text, usage = time.perf_counter(), None, [], None
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                usage = chunk.get("usage") or usage
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - started
                    text.append(chunk["choices"][0]["delta"]["content"])
        reply = "".join(text)
        prompt = self.loaded.tokenizer.encode(self.loaded.chat_template.render(messages), add_special=False)
        shared = common_prefix_len(prompt, self.seen.get(key, []))
        self.seen[key] = prompt + self.loaded.tokenizer.encode(reply, add_special=False)
        computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        return {"reply": reply, "prompt": usage["prompt_tokens"], "computed": computed,
                "ideal": len(prompt) - shared + 1, "ttft": ttft or 0.0,
                "reread": shared > 0 and usage["prompt_tokens_details"]["cached_tokens"] < shared / 2}


def play_round(client, conversations: dict[str, list[dict]], turn: int) -> list[dict]:
    """One turn of every conversation, in an order shuffled per round (a fixed order would let round-robin
    land each conversation on the same replica every time); each reply and the next question join its
    history."""
    rows = []
    order = list(conversations)
    random.Random(turn).shuffle(order)
    for key in order:
        messages = conversations[key]
        row = client.turn(key, messages)
        messages += [{"role": "assistant", "content": row["reply"]},
                     {"role": "user", "content": f"Go on with part {turn + 2}, in more detail."}]
        rows.append(row)
    return rows


def summary(name: str, rows: list[dict], extra: str = "") -> str:
    prompt, computed, ideal = (sum(r[k] for r in rows) for k in ("prompt", "computed", "ideal"))
    ttft = statistics.median(r["ttft"] for r in rows) * 1e3
    return (f"| {name} | {len(rows)} | {prompt} | {computed} | {ideal} | {computed / ideal:.2f} | "
            f"{sum(r['reread'] for r in rows)} | {ttft:.0f} | {extra} |")


def tier_moves(replicas: list[Replica]) -> str:
    """Cache moves summed over the replicas: device <-> host parks/restores, spills and loads from disk."""
    usage = [r.state.engine.cache.usage() for r in replicas]
    total = {k: sum(u[k] for u in usage) for k in ("parks", "restores", "spills", "disk_loads")}
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in total.items())


def holders(replicas: list[Replica], key: str) -> list[int]:
    return [i for i, r in enumerate(replicas) if any(c["key"] == key for c in r.state.engine.conversations.snapshot())]


def run_policy(router, loaded, replicas, name, args, workdir: Path, misses: MissLines) -> list[str]:
    for replica in replicas:
        replica.start()  # a fresh state: empty device and host tiers (each disk dir is new per policy)
    lines = []
    try:
        urls = [r.url for r in replicas]
        with running_router(router, urls, workdir / f"router-{name.split()[0]}.log", *POLICIES[name]) as url:
            client = Client(url, loaded, send_key=name.startswith("key"))
            conversations = {f"conv-{i}": [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}]
                             for i in range(6)}
            rows = [row for t in range(args.turns) for row in play_round(client, conversations, t)]
            spread = [len([k for k in conversations if holders(replicas, k) == [i]]) for i in range(len(replicas))]
            lines.append(summary(name, rows, "conversations kept on one replica: " + ", ".join(map(str, spread))
                                 + "; " + tier_moves(replicas)))
            if name.startswith("key"):
                lines += replica_loss(client, replicas, conversations, url, args.turns, misses)
    finally:
        for replica in replicas:
            replica.stop()
    return lines


def replica_loss(client, replicas, conversations, url, turn, misses: MissLines) -> list[str]:
    lost = replicas[0]
    moved = [k for k in conversations if holders(replicas, k) == [0]]
    lost.stop()
    wait_for_workers(url, lambda ws: not healthy(ws)[lost.url])
    before = len(misses.lines)
    rows = play_round(client, conversations, turn)
    said = [m for m in misses.lines[before:]]
    lines = [summary("key: replica 0 stopped", rows, f"{len(moved)} moved ({', '.join(moved)}); "
                     f"'no replica held it' lines: {len(said)}")]
    lost.start()  # same port, same disk tier: it reloads what it flushed at the stop
    wait_for_workers(url, lambda ws: all(healthy(ws).values()))
    before = len(misses.lines)
    rows = play_round(client, conversations, turn + 1)
    back = [k for k in moved if 0 in holders(replicas, k)]
    disk = sum(d for _, d in misses.lines[before:])
    lines.append(summary("key: replica 0 back", rows, f"{len(back)} of {len(moved)} back on replica 0, "
                         f"{disk} tokens from its disk tier"))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, from: " + ", ".join(POLICIES))
    args = ap.parse_args()
    router = router_python()
    if router is None:
        print("sglang-router could not be installed (scripts/install_router.sh failed)", file=sys.stderr)
        return 1
    misses = MissLines()
    logging.getLogger("strata").setLevel(logging.INFO)
    logging.getLogger("strata").addHandler(misses)
    logging.getLogger("uvicorn.error").setLevel(logging.ERROR)  # the router's gRPC probe: "Invalid HTTP request"
    loaded = open_model("smollm2", max_positions=512)  # shared: requests go one at a time
    print(f"{args.replicas} replicas, 6 conversations x {args.turns} turns, then the replica-loss sequence")
    print("| routing | requests | prompt tokens | computed | ideal | computed / ideal | full re-reads | "
          "TTFT median (ms) | notes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.policies.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            replicas = [Replica(loaded, conversation_cache_dir=str(workdir / f"disk-{i}"), **REPLICA_CONFIG)
                        for i in range(args.replicas)]
            for line in run_policy(router, loaded, replicas, name, args, workdir, misses):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
