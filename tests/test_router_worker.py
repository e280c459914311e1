"""Two strata servers behind the real SGLang router (PyPI `sglang-router` 0.3.x, installed at run time by
scripts/install_router.sh; skipped when the wheel cannot be installed).

The router registers both from what they answer (/health, /server_info, /model_info), reads their load
(/get_load), keeps each conversation on one replica by its routing key (`--policy manual`), moves a
conversation to the other replica when its own stops (the receiving replica logs that no replica held it
there), and hands it back when the first restarts with its disk tier, which still holds the early turns.
"""
import logging

import httpx
import pytest

from engine.loader import open_model
from tests.support.router_harness import Replica, healthy, router_python, running_router, wait_for_workers

pytestmark = pytest.mark.slow
SYSTEM = "You are a terse assistant."


@pytest.fixture(scope="module")
def router():
    python = router_python()
    if python is None:
        pytest.skip("sglang-router could not be installed (scripts/install_router.sh failed)")
    return python


class Conversation:
    def __init__(self, key: str, question: str):
        self.key = key
        self.prompt_tokens = 0  # of the last turn
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    def turn(self, router_url: str, next_question: str | None = None) -> dict:
        """One turn through the router; the reply joins the history, then the next question (if any)."""
        body = {"model": "smollm2", "messages": self.messages, "max_tokens": 4, "temperature": 0,
                "prompt_cache_key": self.key}  # the router forwards it: the replica names the conversation
        reply = httpx.post(router_url + "/v1/chat/completions", json=body, timeout=300,
                           headers={"X-SMG-Routing-Key": self.key})
        assert reply.status_code == 200, reply.text
        data = reply.json()
        self.prompt_tokens = data["usage"]["prompt_tokens"]
        self.messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        if next_question:
            self.messages.append({"role": "user", "content": next_question})
        return data["usage"]


def _unseen(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if getattr(r, "fields", {}).get("miss") == "unseen"]


def _turns_on(replica: Replica, key: str) -> int:
    return next((c["turns"] for c in replica.state.engine.conversations.snapshot() if c["key"] == key), 0)


def test_router_registers_balances_and_moves_conversations(router, smollm2, smollm2_path, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    common = dict(batch=1, ctx_size=512, conversation_cache_mib=16)
    a = Replica(smollm2, conversation_cache_dir=str(tmp_path / "disk-a"), **common).start()
    b = Replica(open_model(str(smollm2_path)), **common).start()
    try:
        # --cb-failure-threshold 3 (docs/DEPLOY.md): a request that finds its replica gone opens the circuit
        # within its 5 retries and is retried on the other replica, before any health check has run; the
        # circuit tries to close after --cb-timeout-duration-secs (default 60), whatever the health checks say
        with running_router(router, [a.url, b.url], tmp_path / "router.log", "--policy", "manual",
                            "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "1") as url:
            workers = wait_for_workers(url, lambda ws: len(ws) == 2)
            assert {w["model_id"] for w in workers} == {a.state.served_name}  # from /server_info
            assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == a.state.served_name
            loads = httpx.get(url + "/get_loads").json()["workers"]
            assert sorted(entry["load"] for entry in loads) == [0, 0]  # /get_load parsed (-1 means it was not)

            # The manual policy places a new key on a random healthy worker: open conversations until each
            # replica holds one (12 keys all on one replica: p = 2 ** -11).
            home: dict[Replica, Conversation] = {}
            for i in range(12):
                conv = Conversation(f"conv-{i}", f"Name a colour, number {i}.")
                conv.turn(url, "And another?")
                home.setdefault(a if _turns_on(a, conv.key) else b, conv)
                if len(home) == 2:
                    break
            c1, c2 = home[a], home[b]
            for conv in (c1, c2):
                before = conv.prompt_tokens
                usage = conv.turn(url, "One more?")
                assert usage["prompt_tokens_details"]["cached_tokens"] >= before  # the whole last prompt reused
            for replica, conv in home.items():
                assert _turns_on(replica, conv.key) == 2  # both turns on the replica that took the first
            moved = c1  # the conversation whose replica will stop

            a.stop()  # flushes its cache to its disk tier
            usage = moved.turn(url, "Last one?")  # at once: answered (turn() asserts 200), by b
            wait_for_workers(url, lambda ws: healthy(ws) == {a.url: False, b.url: True})
            assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] // 2  # a re-read
            assert _turns_on(b, moved.key) == 1
            [unseen] = _unseen(caplog)
            assert unseen["conversation"] == moved.key and unseen["earlier_turns"] == 2 and unseen["disk"] == 0

            a.start()  # same port, same disk tier
            wait_for_workers(url, lambda ws: healthy(ws) == {a.url: True, b.url: True})
            usage = moved.turn(url)
            assert _turns_on(a, moved.key) == 1 and _turns_on(b, moved.key) == 1  # back on its first replica
            [summary] = [r.fields for r in caplog.records if "reused_disk" in getattr(r, "fields", {})
                         and r.fields.get("conversation") == moved.key][-1:]
            assert summary["reused_disk"] > 0  # its first two turns, from the disk tier
            assert _unseen(caplog)[-1]["disk"] == summary["reused_disk"]  # said so in the miss line
            assert usage["prompt_tokens_details"]["cached_tokens"] == summary["reused_tokens"]
    finally:
        a.stop()
        b.stop()
