"""A reply's own tokens through the server (issue 28): the next turn's prompt carries the previous reply as the
ids the model generated, so the cache matches through it, also when its text re-encodes to other ids.

The invariant that replaces "cache on == cache off" for such prompts: a conversation served turn by turn equals
a session that never left the server, in which each turn's ids are the previous turn's prompt ids, the ids
the model generated, then the new text encoded going on from them (engine/generate.py runs that session here
without the server or its cache)."""
import logging

import httpx
import pytest

from api.chat_turn import ChatTurn, render_turn
from api.tool_specs import normalise_tools
from engine.generate import generate
from engine.loader import encode_chat_prompt
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from tests.support.server_harness import running_server
from tests.support.reply_model import FIRST, MAX_TOKENS, open_reply_model

@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return open_reply_model(tmp_path_factory.mktemp("reply"))


def _chat(url, model, messages, **sampling):
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **sampling}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    return reply["choices"][0]["message"]["content"], reply["usage"], reply["choices"][0]["finish_reason"]


def _next(messages, reply, user="And then?"):
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]


def test_a_reply_that_re_encodes_differently_is_matched_to_its_end_and_its_checkpoint(lfm2):
    with running_server(lfm2, batch=2, ctx_size=512) as (url, state):
        reply, first, finish = _chat(url, state.served_name, FIRST)
        assert finish == "length" and len(lfm2.tokenizer.encode(reply, add_special=False)) < MAX_TOKENS
        _, second, _ = _chat(url, state.served_name, _next(FIRST, reply))
        # everything but the reply's last token (sampled, never computed): the state checkpoint at its end
        assert second["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] + MAX_TOKENS - 1
        cache = httpx.get(url + "/cache", timeout=30).json()
    assert cache["checkpoints_restored"] == 1 and cache.get("miss_no_checkpoint", 0) == 0
    replies = cache["replies"]
    assert (replies["replies_kept"], replies["reply_tokens_kept"], replies["replies_kept_split_differently"]) \
        == (1, MAX_TOKENS, 1)
    state.engine.cache.check_integrity()


def test_sampled_replies_are_matched_to_their_end(lfm2):
    with running_server(lfm2, batch=2, ctx_size=512) as (url, state):
        messages, differing = FIRST, 0
        for seed in range(3):
            reply, first, finish = _chat(url, state.served_name, messages, temperature=1.0, seed=seed)
            differing += len(lfm2.tokenizer.encode(reply, add_special=False)) != first["completion_tokens"]
            messages = _next(messages, reply, f"Part {seed + 2}?")
            _, second, _ = _chat(url, state.served_name, messages, max_tokens=1)
            computed_reply = first["completion_tokens"] - (finish == "length")  # a length cut's last: not fed
            assert second["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] + computed_reply
        state.engine.cache.check_integrity()
    assert differing  # sampled replies (random bytes, partial UTF-8) that the tokenizer splits otherwise


def test_with_keep_reply_tokens_off_the_match_stops_before_the_reply(lfm2):
    with running_server(lfm2, batch=2, ctx_size=512, keep_reply_tokens="off") as (url, state):
        reply, first, _ = _chat(url, state.served_name, FIRST)
        _, second, _ = _chat(url, state.served_name, _next(FIRST, reply))
        cache = httpx.get(url + "/cache", timeout=30).json()
    assert second["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"]
    assert "replies" not in cache


def test_an_edited_reply_is_read_from_its_text_and_the_miss_is_explained(lfm2, caplog):
    with running_server(lfm2, batch=2, ctx_size=512) as (url, state):
        reply, first, _ = _chat(url, state.served_name, FIRST)
        with caplog.at_level(logging.INFO):
            _, second, _ = _chat(url, state.served_name, _next(FIRST, "t" + reply))
        cache = httpx.get(url + "/cache", timeout=30).json()
    assert second["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"]
    assert cache["replies"]["replies_not_as_generated"] == 1 and cache["replies"]["replies_kept"] == 0
    assert "message 2 is not the reply generated there" in caplog.text
    assert "(message 2 (assistant))" in caplog.text  # the cache's own explanation of where it diverged


def test_a_conversation_served_turn_by_turn_equals_a_session_that_never_left_the_server(lfm2):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    runner = ModelRunner(lfm2.model, 128, 16)
    tokenizer, messages, ids = lfm2.tokenizer, FIRST, None
    with running_server(lfm2, batch=2, ctx_size=512) as (url, state):
        for turn in range(3):
            text = render_turn(state, ChatTurn(messages, normalise_tools(None)))
            if ids is None:
                ids = encode_chat_prompt(tokenizer, text)
            else:  # the session goes on: the text after what it already holds, encoded going on from it
                ids = ids + tokenizer.encode(text[len(session_text):], add_special=False, continues=True)
            session = generate(runner, tokenizer, ids, params)
            reply, usage, _ = _chat(url, state.served_name, messages)
            assert (reply, usage["prompt_tokens"]) == (session.text, len(ids)), f"turn {turn}"
            ids, session_text = ids + session.token_ids, text + session.text
            messages = _next(messages, reply, f"Part {turn + 2}?")
