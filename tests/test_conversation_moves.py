"""A named conversation that arrives with earlier turns at a replica that never served it (its replica
stopped, or a router moved it) is explained as such, and only then: not on its first turn, not on a
replica that served it, not for an unnamed request."""
import asyncio
import logging

import numpy as np
import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.cache.explain import explain_unseen
from scheduler.cache.tree import PrefixMatch
from scheduler.conversations import ConversationLog
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("llama", seed=5, n_ctx=512)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def _run(loop, *requests):
    async def main():
        loop.start()
        for request in requests:  # one after another, as a conversation's turns arrive
            async for _ in loop.submit(request):
                pass
        await loop.shutdown(1)
    asyncio.run(main())


def _request(rid, prompt, key=None, earlier_turns=0):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return Request(rid, prompt, params, conversation_key=key, earlier_turns=earlier_turns)


def _unseen_lines(caplog):
    return [r for r in caplog.records if getattr(r, "fields", {}).get("miss") == "unseen"]


def _loop(tiny):
    model, tokenizer = tiny
    return EngineLoop(ModelRunner(model, 128, 4), tokenizer, num_slots=2, prefill_chunk=16, max_queue=4)


def test_explain_unseen_only_for_a_named_continued_conversation_not_served_here():
    match = PrefixMatch([], None, 8)
    assert explain_unseen("c1", False, 2, match) == {"cause": "unseen", "position": 8, "earlier_turns": 2,
                                                     "disk_tokens": 0}
    assert explain_unseen("c1", False, 2, match, disk_tokens=8)["disk_tokens"] == 8
    assert explain_unseen("c1", True, 2, match) is None  # served here: the cache explains its misses
    assert explain_unseen("c1", False, 0, match) is None  # a new conversation is new everywhere
    assert explain_unseen(None, False, 2, match) is None  # unnamed: nothing says it was served elsewhere


def test_conversation_log_knows_the_conversations_it_recorded_within_capacity():
    log = ConversationLog(capacity=2)
    for key in ("a", "b", "c"):
        log.record(key, "r", 10, 0)
    assert "a" not in log and "b" in log and "c" in log


def test_a_moved_conversation_is_logged_as_held_by_no_replica_here(tiny, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    history = _prompt(40, seed=1)
    _run(_loop(tiny), _request("t3", history + _prompt(6, seed=2), key="conv-9", earlier_turns=2))
    [line] = _unseen_lines(caplog)
    assert line.fields["conversation"] == "conv-9" and line.fields["earlier_turns"] == 2
    assert line.fields["position"] == 0  # nothing of it was cached here
    assert "no replica held it here" in line.getMessage()


def test_no_unseen_line_on_the_replica_that_served_the_earlier_turns(tiny, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    turn1 = _prompt(40, seed=3)
    turn2 = turn1 + _prompt(8, seed=4)
    _run(_loop(tiny), _request("t1", turn1, key="conv-1"), _request("t2", turn2, key="conv-1", earlier_turns=1),
         _request("u", turn2 + [7, 8], key=None, earlier_turns=1))
    assert _unseen_lines(caplog) == []
