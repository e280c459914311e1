"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), driven by the real `anthropic` SDK
on SmolLM2 (generic tool format: the grammar keeps a 135M model inside the tool-call JSON).

The SDK no longer takes temperature as an argument; greedy runs send it through ``extra_body``.
"""
import json

import anthropic
import httpx
import jsonschema
import pytest

from api import reply_stream
from api.messages_api import conversation_key
from api.messages_events import BlockWriter
from api.messages_schema import function_tools, template_messages, tool_choice
from api.tool_calls import ParsedDelta, ToolCallDelta
from tests.support.server_harness import running_server, text_of_this_test

pytestmark = pytest.mark.slow
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


def billing_system(value: str) -> list[dict]:
    """Claude Code's system blocks: a billing line whose value changes per request, then the real prompt."""
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{value}; cc_entrypoint=cli;"},
            {"type": "text", "text": "You are a helpful assistant.", "cache_control": {"type": "ephemeral"}}]


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)


def raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed reply, as sent on the wire."""
    events = []
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "fine-grained-tool-streaming"}
    with httpx.stream("POST", url + "/v1/messages?beta=true", json={**body, "stream": True}, timeout=120,
                      headers=headers) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


def collapse(events) -> list[str]:
    """Event names with runs of the same content_block_delta type folded into one."""
    names = []
    for name, data in events:
        label = f"{name}:{data['delta']['type']}" if name == "content_block_delta" else name
        if not names or names[-1] != label or not name == "content_block_delta":
            names.append(label)
    return names


def test_body_translation():
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                     {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "thanks"}]},
        {"role": "system", "content": "# Environment"},  # Claude Code 2.1.3xx sends one after the first turn
    ]
    messages = template_messages(billing_system("abc"), conversation)
    assert messages == [
        {"role": "system", "content": "You are a helpful assistant."},  # the billing line is gone
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "Error: timeout"},
        {"role": "user", "content": "thanks"},
        {"role": "system", "content": "# Environment"},
    ]
    folded = template_messages(None, conversation, system_turns=False)  # for templates like Gemma's
    assert folded[-1] == {"role": "user", "content": "thanks\n# Environment"}
    loaded = set()
    template_messages(None, [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "tool_reference", "tool_name": "WebFetch"}]}]}], loaded)
    deferred = {"name": "WebFetch", "input_schema": {"type": "object"}, "defer_loading": True}
    assert function_tools([deferred]) == [] and len(function_tools([deferred], loaded)) == 1
    assert [t["function"]["name"] for t in function_tools([WEATHER, {"type": "web_search_20250305",
                                                                      "name": "web_search"}])] == ["get_weather"]
    assert tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert tool_choice({"type": "tool", "name": "f"}) == ({"type": "function", "function": {"name": "f"}}, None)
    assert tool_choice(None) == (None, None)  # unsaid: the format decides (generic_json: one call)
    assert conversation_key({"x-claude-code-session-id": "s1"}, None) == "s1"
    assert conversation_key({}, {"user_id": json.dumps({"device_id": "d", "session_id": "s2"})}) == "s2"
    assert conversation_key({}, {"user_id": "user_ab_account__session_s3"}) == "s3"


def test_block_writer_events():
    writer = BlockWriter()
    events = writer.feed(ParsedDelta(reasoning="Think.", content="Hi"))
    calls = [ToolCallDelta(0, "call_1", "f", '{"a": '), ToolCallDelta(0, None, None, "1}")]
    events += writer.feed(ParsedDelta(tool_calls=calls))
    events += writer.close()
    labels = [name + (":" + data["delta"]["type"] if "delta" in data else "") for name, data in events]
    assert labels == ["content_block_start", "content_block_delta:thinking_delta",
                      "content_block_delta:signature_delta", "content_block_stop",
                      "content_block_start", "content_block_delta:text_delta", "content_block_stop",
                      "content_block_start", "content_block_delta:input_json_delta",
                      "content_block_delta:input_json_delta", "content_block_stop"]
    assert events[0][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert writer.blocks == [{"type": "thinking", "thinking": "Think.", "signature": writer.blocks[0]["signature"]},
                             {"type": "text", "text": "Hi"},
                             {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]
    assert writer.has_tool_calls


def test_tool_use_whole_streamed_and_counted(server, client):
    kwargs = dict(model="claude-sonnet-5-5", max_tokens=80, messages=ASK, tools=[WEATHER],
                  tool_choice={"type": "any"}, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    call = whole.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    assert whole.model == "claude-sonnet-5-5"  # an unknown name is answered by the served model, echoed
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content] == [(call.name, call.input)]
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == whole.usage.output_tokens
    events = raw_events(server[0], {k: v for k, v in kwargs.items() if k != "extra_body"} | GREEDY)
    assert collapse(events) == ["message_start", "ping", "content_block_start", "content_block_delta:input_json_delta",
                                "content_block_stop", "message_delta", "message_stop"]
    assert events[2][1]["content_block"] == {"type": "tool_use", "id": events[2][1]["content_block"]["id"],
                                             "name": "get_weather", "input": {}}
    arguments = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(arguments) == call.input
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    count = client.messages.count_tokens(model="claude-sonnet-5-5", messages=ASK, tools=[WEATHER],
                                         tool_choice={"type": "any"})
    assert count.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_streamed_text_events_usage_and_stop_sequence(server, client, monkeypatch):
    monkeypatch.setattr(reply_stream, "KEEPALIVE_S", 0.02)  # every gap between tokens gets a ping
    body = {"model": "smollm2", "max_tokens": 12, "messages": [{"role": "user", "content": "Tell me about Paris."}],
            "system": "Be brief.", **GREEDY}
    events = raw_events(server[0], body)
    names = collapse([event for event in events if event[0] != "ping"])
    assert names == ["message_start", "content_block_start", "content_block_delta:text_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[1][0] == "ping" and sum(n == "ping" for n, _ in events) > 1
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["role"] == "assistant" and start["content"] == []
    assert set(start["usage"]) == {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
                                   "output_tokens"}
    final = events[-2][1]
    assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert final["usage"]["input_tokens"] == start["usage"]["input_tokens"]  # message_start knew the reuse
    assert final["usage"]["cache_read_input_tokens"] == start["usage"]["cache_read_input_tokens"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    fields = {k: v for k, v in body.items() if k in ("model", "max_tokens", "messages", "system")}
    cut = client.messages.create(**fields, stop_sequences=["never-seen", stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_second_turn_reuses_the_first_despite_a_changing_billing_header(client, request):
    headers = {"x-claude-code-session-id": "test-session"}
    ask = [{"role": "user", "content": text_of_this_test(request, ASK[0]["content"])}]  # the shared server's cache
    first = client.messages.create(model="claude-sonnet-5-5", max_tokens=80, system=billing_system("a1"),
                                   messages=ask, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY,
                                   extra_headers=headers)
    call = first.content[0]
    history = ask + [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 degrees celsius, sunny"}]}]
    second = client.messages.create(model="claude-sonnet-5-5", max_tokens=16, system=billing_system("b2"),
                                    messages=history, tools=[WEATHER], extra_body=GREEDY, extra_headers=headers)
    # The reply re-renders byte-identically and the billing line never reaches the prompt: all of turn one is
    # reused, its prompt and every generated token but the last (sampled, never fed back).
    first_total = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens == first_total - 1
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_errors_are_anthropic_shaped(server, client):
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                        "data": "AAAA"}}]}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="smollm2", max_tokens=8, messages=image)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "'image'" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="smollm2", max_tokens=8, messages=[{"role": "user", "content": "word " * 2100}])
    assert info.value.body["error"]["message"].startswith("prompt is too long: ")  # what Claude Code matches
    response = httpx.post(server[0] + "/v1/messages", json={"model": "smollm2", "messages": ASK}, timeout=30)
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]


def test_api_key_as_x_api_key_or_bearer(smollm2):
    with running_server(smollm2, ctx_size=256, batch=1, api_key="secret") as (url, _):
        count = dict(model="smollm2", messages=ASK)
        assert anthropic.Anthropic(base_url=url, api_key="secret").messages.count_tokens(**count).input_tokens > 0
        assert anthropic.Anthropic(base_url=url, auth_token="secret").messages.count_tokens(**count).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as info:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(max_tokens=4, **count)
        assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
