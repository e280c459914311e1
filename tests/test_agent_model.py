"""The agent model (Qwen2.5-Coder-0.5B-Instruct, the default model, fetched through the model store) in a tool loop
through each dialect's official SDK: the model's own call (it writes calls as fenced JSON, not in its template's
<tool_call> markup) is recognised, executed, and the answer comes after the result; JSON answers stay content.

Greedy (temperature 0) so each run is the same; the model's recommended sampling is tested elsewhere.
"""
import json

import pytest

from tests.support.server_harness import running_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

NOTE = "The launch code is 7481-ZETA."
TASK = "Read the file note.txt and tell me the launch code written in it."
READ_FILE = {"name": "read_file", "description": "Read a file and return its text",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@pytest.fixture(scope="module")
def agent_server(qwen_coder_path):
    from engine.loader import open_model

    loaded = open_model(str(qwen_coder_path), max_positions=4096)
    with running_server(loaded, batch=1, ctx_size=4096) as (url, state):
        yield url, state


def _recovered(state) -> float:
    return sum(sample.value for metric in state.metrics.tool_calls_recovered.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


def test_chat_completions_tool_loop(agent_server):
    url, state = agent_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    before = _recovered(state)
    messages = [{"role": "user", "content": TASK}]
    tools = [{"type": "function", "function": READ_FILE}]
    first = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages, tools=tools,
                                           temperature=0, max_tokens=100)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("read_file", {"path": "note.txt"})
    assert _recovered(state) == before + 1  # it came as a fenced JSON block, not <tool_call>
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": NOTE}]
    second = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages, tools=tools,
                                            temperature=0, max_tokens=100)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert "7481-ZETA" in second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * first.usage.prompt_tokens


def test_responses_tool_loop(agent_server):
    url, _ = agent_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    tools = [{"type": "function", **READ_FILE}]
    first = client.responses.create(model="qwen2.5-coder-0.5b", input=TASK, tools=tools, temperature=0,
                                    max_output_tokens=100, store=False)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("read_file", {"path": "note.txt"})
    items = [{"role": "user", "content": TASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": NOTE}]
    second = client.responses.create(model="qwen2.5-coder-0.5b", input=items, tools=tools, temperature=0,
                                     max_output_tokens=100, store=False)
    assert not [item for item in second.output if item.type == "function_call"]
    assert "7481-ZETA" in second.output_text


def test_messages_tool_loop(agent_server):
    url, _ = agent_server
    client = anthropic.Anthropic(base_url=url, api_key="x")
    tools = [{"name": READ_FILE["name"], "description": READ_FILE["description"],
              "input_schema": READ_FILE["parameters"]}]
    messages = [{"role": "user", "content": TASK}]
    first = client.messages.create(model="qwen2.5-coder-0.5b", messages=messages, tools=tools, max_tokens=100,
                                   extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert (use.name, use.input) == ("read_file", {"path": "note.txt"})
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": NOTE}]}]
    second = client.messages.create(model="qwen2.5-coder-0.5b", messages=messages, tools=tools, max_tokens=100,
                                    extra_body={"temperature": 0})
    assert second.stop_reason == "end_turn"
    assert "7481-ZETA" in "".join(block.text for block in second.content if block.type == "text")


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_answer_the_user_asked_for_stays_content(agent_server, stream):
    url, state = agent_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    before = _recovered(state)
    ask = [{"role": "user", "content": "Give me a JSON object describing Paris with the keys name and country. "
                                       "Reply with only the JSON."}]
    reply = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=ask,
                                           tools=[{"type": "function", "function": READ_FILE}], temperature=0,
                                           max_tokens=60, stream=stream)
    if stream:
        chunks = list(reply)
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert not any(chunk.choices[0].delta.tool_calls for chunk in chunks if chunk.choices)
    else:
        content = reply.choices[0].message.content
        assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"
    assert json.loads(content.strip().removeprefix("```json").removesuffix("```")) == {"name": "Paris",
                                                                                       "country": "France"}
    assert _recovered(state) == before


def test_a_streamed_call_never_shows_as_content(agent_server):
    url, _ = agent_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    chunks = list(client.chat.completions.create(
        model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": TASK}],
        tools=[{"type": "function", "function": READ_FILE}], temperature=0, max_tokens=100, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == ""
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert calls[0].function.name == "read_file"
    assert json.loads("".join(call.function.arguments or "" for call in calls)) == {"path": "note.txt"}
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
