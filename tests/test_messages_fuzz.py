"""Fuzz POST /v1/messages and /v1/messages/count_tokens with hypothesis: Anthropic publishes no OpenAPI
document like OpenAI's, so the bodies come from a hand-written strategy that mixes Anthropic's shapes
(text, tool_use, tool_result, thinking, image blocks; tools; tool_choice; thinking) with wrong types, missing
fields and unknown block kinds at every level. Every answer must hold:
- no 5xx, ever (a streamed reply ends with message_stop, never an error event);
- every 4xx is Anthropic's error object ``{"type": "error", "error": {"type", "message"}}`` with the type
  Anthropic uses for that status (400 invalid_request_error, 404 not_found_error);
- a 200 is a message (or, for count_tokens, ``{"input_tokens": n}``).
Output is capped at two tokens: ``max_tokens`` is drawn from 0..2 when it is an integer at all.
"""
from __future__ import annotations

import os

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

SERVED_NAME = "smollm2"  # a name the shared server answers to (conftest's `server`: --model smollm2)
EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "40"))  # per test; raise it locally for a longer hunt
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))

text = st.text(max_size=12)
scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False, allow_infinity=False) | text
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=6)


def mostly(good, bad):
    """``good`` in about eleven draws of twelve, else ``bad``. (``st.one_of(good, bad)`` draws the richer
    branch nearly every time, and repeating a branch in it does not weigh it: the branches are deduplicated.)
    Shrinking moves the choice to 0, towards ``good``."""
    return st.tuples(st.integers(0, 7), good, bad).map(lambda drawn: drawn[2] if drawn[0] == 5 else drawn[1])


def maybe(strategy):
    """Mostly ``strategy``, sometimes junk: every level gets wrong types, yet most bodies get deep."""
    return mostly(strategy, junk)


block_kinds = st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image",
                               "document", "tool_reference", "server_tool_use", "search_result"]) | text
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": maybe(text)},
                                   optional={"cache_control": maybe(st.just({"type": "ephemeral"}))})
tool_use = st.fixed_dictionaries({"type": st.just("tool_use")}, optional={
    "id": maybe(st.just("toolu_1")), "name": maybe(st.just("get_weather")), "input": maybe(st.just({"city": "x"}))})
tool_result = st.fixed_dictionaries({"type": st.just("tool_result")}, optional={
    "tool_use_id": maybe(st.just("toolu_1")), "is_error": maybe(st.booleans()),
    "content": maybe(text | st.lists(text_block | junk, max_size=2))})
thinking = st.fixed_dictionaries({"type": st.just("thinking")},
                                 optional={"thinking": maybe(text), "signature": maybe(text)})
image = st.fixed_dictionaries({"type": st.just("image"), "source": junk})
other_block = st.fixed_dictionaries({"type": block_kinds}, optional={"text": junk, "content": junk})
block = maybe(st.one_of(text_block, tool_use, tool_result, thinking, image, other_block))
content = maybe(text | st.lists(block, max_size=3))
message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant", "system"])), "content": content})
schema = st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
tool = st.fixed_dictionaries({}, optional={"name": maybe(st.just("get_weather")), "description": maybe(text),
                                           "input_schema": maybe(schema), "type": maybe(text)})
tool_choice = st.fixed_dictionaries({"type": maybe(st.sampled_from(["auto", "any", "tool", "none"]))},
                                    optional={"name": maybe(st.just("get_weather")),
                                              "disable_parallel_tool_use": maybe(st.booleans())})
thinking_config = st.fixed_dictionaries({"type": maybe(st.sampled_from(["enabled", "disabled", "adaptive"]))},
                                        optional={"budget_tokens": maybe(st.integers(0, 2048))})
prompt_fields = {
    "system": maybe(text | st.lists(maybe(text_block), max_size=2)),
    "tools": maybe(st.lists(maybe(tool), max_size=2)),
    "tool_choice": maybe(tool_choice),
    "thinking": maybe(thinking_config),
    "metadata": maybe(st.just({"user_id": "u1"})),
}
prompt_body = st.fixed_dictionaries(
    {"model": maybe(st.just(SERVED_NAME) | text), "messages": maybe(st.lists(maybe(message), min_size=1, max_size=3))},
    optional=prompt_fields)
messages_body = st.fixed_dictionaries(
    {"model": maybe(st.just(SERVED_NAME) | text), "messages": maybe(st.lists(maybe(message), min_size=1, max_size=3)),
     "max_tokens": maybe(st.integers(0, 2))},
    optional={**prompt_fields, "stop_sequences": maybe(st.lists(text, max_size=3)),
              "temperature": maybe(st.floats(-1, 2)), "top_p": maybe(st.floats(0, 1)),
              "top_k": maybe(st.integers(-1, 50)), "stream": maybe(st.booleans())})
raw = st.binary(max_size=16) | junk.map(orjson.dumps)  # not an object at all, or not JSON


@pytest.fixture(scope="module")
def url(server):
    """The default model's server that the API tests share (tests/conftest.py)."""
    return server[0]


def _assert_anthropic_error(response: httpx.Response) -> None:
    assert response.status_code in ERROR_TYPES, f"{response.status_code}: {response.text}"
    body = response.json()
    assert body.keys() == {"type", "error"} and body["type"] == "error", body
    assert body["error"].keys() == {"type", "message"}, body
    assert body["error"]["type"] == ERROR_TYPES[response.status_code], body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def _post(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def _assert_stream_ends_well(response: httpx.Response) -> None:
    events = [line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")]
    assert events and events[-1] == "message_stop" and "error" not in events, response.text


@FUZZ_SETTINGS
@given(body=mostly(messages_body, raw))
def test_messages_answers_every_generated_body(url, body):
    response = _post(url, "/v1/messages", body)
    if response.status_code != 200:
        _assert_anthropic_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        _assert_stream_ends_well(response)
    else:
        reply = response.json()
        assert reply["type"] == "message" and reply["role"] == "assistant", reply
        assert isinstance(reply["content"], list) and reply["usage"]["output_tokens"] <= 2, reply


@FUZZ_SETTINGS
@given(body=mostly(prompt_body, raw))
def test_count_tokens_answers_every_generated_body(url, body):
    response = _post(url, "/v1/messages/count_tokens", body)
    if response.status_code != 200:
        _assert_anthropic_error(response)
    else:
        count = response.json()["input_tokens"]
        assert isinstance(count, int) and count > 0, response.text
