"""--tool-call-format generic_json on SmolLM2 through the `openai` client: a call, its result, then an answer.

generic_json is llama.cpp's generic format (every reply JSON: a call object or {"response": ...}, one call
per reply unless parallel_tool_calls is true). With it SmolLM2-135M opens a call when asked to use a tool,
and after the plain-text tool result answers; the second turn reuses the first turn's prompt and reply.
"""
import json

import jsonschema
import openai
import pytest

from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow
READ_PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file and return its text.",
                                           "parameters": READ_PARAMETERS}},
         {"type": "function", "function": {"name": "shell", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]
TASK = [{"role": "system", "content": "You are a coding agent. You have tools; use them."},
        {"role": "user", "content": "Use the read_file tool to read hello.txt, then tell me what it says."}]


@pytest.fixture(scope="module")
def client(smollm2):
    with running_server(smollm2, ctx_size=2048, batch=1, tool_call_format="generic_json") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_a_call_then_an_answer_with_the_prefix_reused(client):
    first = client.chat.completions.create(model="smollm2", messages=TASK, tools=TOOLS, temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls unsaid: one call, as llama-server
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, READ_PARAMETERS | {"additionalProperties": False})
    history = TASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "hello from the scratch folder\n"}]
    second = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=60)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "scratch folder" in answer.message.content.lower()
    # the first turn's prompt and its reply are reused, but for the reply's last few tokens: the grammar let the
    # model spell the closing "}]}" in other pieces than the tokenizer gives the re-rendered text (measured: 3)
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert reused >= first.usage.prompt_tokens + first.usage.completion_tokens - 4
    assert reused < second.usage.prompt_tokens


def test_parallel_calls_when_the_request_asks(client):
    reply = client.chat.completions.create(model="smollm2", messages=TASK, tools=TOOLS, temperature=0, max_tokens=40,
                                           parallel_tool_calls=True, tool_choice="required")
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) >= 2  # SmolLM2 goes on calling when the grammar lets it
