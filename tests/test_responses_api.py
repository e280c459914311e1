"""POST /v1/responses, driven by the real `openai` SDK on SmolLM2 (the generic tool format), plus the two
pieces that need no server: the item -> message translation and the event writer."""
import itertools
import json
import logging

import httpx
import jsonschema
import openai
import pytest

from api.responses_events import ResponseWriter
from api.responses_schema import ResponsesRequest, turn_from_request
from api.tool_calls import ParsedDelta, ToolCallDelta
from tests.support.server_harness import SHARED_SERVER_FIELDS, text_of_this_test

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": WEATHER_PARAMETERS, "strict": True}  # the Responses API's flat tool shape
ASK = "What is the weather in Paris?"


def _types(events) -> list[str]:
    """Event types with runs of the same delta collapsed to one."""
    return [kind for kind, _ in itertools.groupby(e.type for e in events)]


def test_items_become_one_assistant_message_per_reply_and_unknown_items_are_skipped(caplog):
    body = ResponsesRequest.model_validate({"model": "m", "instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: on."}]},
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "web_search_call", "id": "ws_1"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}]})
    with caplog.at_level(logging.INFO):
        messages = turn_from_request(body, []).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[0]["content"] == "Be brief.\n\nSandbox: on."
    assert messages[2]["reasoning_content"] == "Use the tool." and messages[2]["content"] is None
    assert [c["function"]["arguments"] for c in messages[2]["tool_calls"]] == [{"a": 1}, {}]
    assert messages[4] == {"role": "tool", "content": "two", "tool_call_id": "c2"}
    assert "web_search_call" in caplog.text


def test_writer_orders_reasoning_message_and_call_events():
    writer = ResponseWriter("resp_1", "m", {}, frozenset({"apply_patch"}))
    events = writer.start() + writer.feed(ParsedDelta(reasoning="hm")) + writer.feed(ParsedDelta(content="Hi"))
    events += writer.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "apply_patch", '{"input": "x"}')]))
    events += writer.finish("completed")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done", "content_part.done",
        "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done",
        "output_item.added", "output_item.done", "completed"]
    assert events[-2]["item"] == {"id": events[-2]["item"]["id"], "type": "custom_tool_call", "status": "completed",
                                  "call_id": "call_1", "name": "apply_patch", "input": "x"}
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message", "custom_tool_call"]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_required_function_call_whole_and_streamed(client):
    kwargs = dict(model="smollm2", input=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                  max_output_tokens=60, store=False)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and [item.type for item in whole.output] == ["function_call"]
    call = whole.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    events = list(client.responses.create(stream=True, **kwargs))
    assert _types(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.function_call_arguments.delta", "response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-2].item.arguments == call.arguments
    assert events[-1].response.output[0].call_id == events[-2].item.call_id


@pytest.mark.slow
def test_streamed_text_reply_hits_max_output_tokens_as_incomplete(client):
    events = list(client.responses.create(model="smollm2", input="Tell me a long story.", temperature=0,
                                          max_output_tokens=6, store=False, stream=True))
    assert _types(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                              "response.content_part.done", "response.output_item.done", "response.incomplete"]
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.usage.output_tokens == 6 and final.usage.total_tokens == final.usage.input_tokens + 6


@pytest.mark.slow
def test_codex_style_second_turn_reuses_the_whole_first_turn(client, request):
    """Codex (store false) sends the function_call item back with its output: the history re-renders
    byte-identically, so turn two reuses turn one's prompt and every generated token but the last."""
    text = text_of_this_test(request, ASK)  # a conversation of its own on the shared server
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    first = client.responses.create(model="smollm2", input=[user], tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=60, store=False, prompt_cache_key="codex-1")
    call = first.output[0]
    second = client.responses.create(
        model="smollm2", tools=[WEATHER], temperature=0, max_output_tokens=8, store=False, prompt_cache_key="codex-1",
        input=[user, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees celsius, sunny"}])
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.status in ("completed", "incomplete")


@pytest.mark.slow
def test_previous_response_id_continues_a_stored_conversation(client, server):
    first = client.responses.create(model="smollm2", input="My name is Ana.", temperature=0, max_output_tokens=5)
    assert first.store is True
    second = client.responses.create(model="smollm2", previous_response_id=first.id, input="What is my name?",
                                     temperature=0, max_output_tokens=5)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the stored history
    stored = httpx.get(f"{server[0]}/v1/responses/{second.id}").json()
    assert stored["id"] == second.id and stored["output"][0]["content"][0]["text"] == second.output_text
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="smollm2", previous_response_id="resp_unknown", input="hi", max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    models = httpx.get(f"{server[0]}/v1/models").json()  # OpenAI's list, and Codex's catalog beside it
    assert models["data"][0]["id"] == models["models"][0]["slug"]
    assert models["models"][0]["context_window"] == SHARED_SERVER_FIELDS["ctx_size"]


@pytest.mark.slow
def test_text_format_json_schema_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = client.responses.create(model="smollm2", input="Name a city in Italy.", temperature=0,
                                    max_output_tokens=60, store=False,
                                    text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                     "strict": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)


@pytest.mark.slow
def test_context_overflow_streams_response_failed(client):
    kwargs = dict(model="smollm2", input="word " * 3000, max_output_tokens=4, store=False)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.error.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # not streamed: the 400 chat completions gives
        client.responses.create(**kwargs)
    assert info.value.code == "context_length_exceeded"


@pytest.mark.slow
def test_custom_tool_call_and_unknown_tools_and_items_never_400(client, caplog):
    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch to files"},
             {"type": "web_search"}, {"type": "local_shell"},
             {"type": "namespace", "name": "agents", "tools": [WEATHER]}]
    items = [{"type": "item_reference", "id": "msg_old"},
             {"role": "user", "content": [{"type": "input_text", "text": "Fix the typo in a.txt."},
                                          {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    with caplog.at_level(logging.INFO):
        reply = client.responses.create(model="smollm2", input=items, tools=tools, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_output_tokens=60, store=False,
                                        include=["reasoning.encrypted_content"], reasoning={"effort": "low"},
                                        metadata={"a": "b"})
    assert [item.type for item in reply.output] == ["custom_tool_call"]
    assert reply.output[0].name == "apply_patch" and isinstance(reply.output[0].input, str)
    assert all(name in caplog.text for name in ("item_reference", "input_image", "web_search", "namespace"))


@pytest.mark.slow
def test_a_request_without_model_is_served_by_the_loaded_model(server):
    # found by tests/test_openapi_fuzz.py: OpenAI's document makes `model` optional, strata answered 400
    url, state = server
    reply = httpx.post(url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "store": False},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == state.served_name and reply.json()["usage"]["output_tokens"] == 2
    unknown = httpx.post(url + "/v1/responses", json={"model": "gpt-5", "input": "Hi"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
