"""qwen3moe and gpt-oss served through the API on tiny models: a chat request equals the engine's own
greedy output, and a second turn computes only what is new (the conversation cache as for dense)."""
import httpx
import pytest

from engine.generate import generate
from engine.loader import encode_chat_prompt, open_model
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.cache.tree import common_prefix_len
from tests.support.served_workload import prompt_ids
from tests.support.server_harness import running_server
from tests.support.tiny_moe_gguf import MOE_ARCHS, write_tiny_moe_gguf


@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_moe") / f"{request.param}.gguf"
    write_tiny_moe_gguf(path, request.param, seed=4)
    return open_model(str(path), fetch=False, backend_name="auto")  # auto: numpy for MoE (no cuda experts)


def chat(url, messages, max_tokens=10):
    body = {"model": "moe", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]


def _greedy(loaded, prompt, max_tokens=10):
    return generate(ModelRunner(loaded.model, 16, 16), loaded.tokenizer, prompt,
                    SamplingParams(temperature=0, max_tokens=max_tokens))


def test_a_chat_request_returns_the_engines_greedy_reply(tiny_moe):
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    prompt = encode_chat_prompt(tiny_moe.tokenizer, tiny_moe.chat_template.render(messages))
    expected = _greedy(tiny_moe, prompt).text
    with running_server(tiny_moe, batch=2, ctx_size=256, served_model_name="moe") as (url, _):
        text, usage = chat(url, messages)
    assert text == expected and usage["prompt_tokens"] == len(prompt)


def test_a_second_turn_computes_only_what_is_new(tiny_moe):
    history = [{"role": "user", "content": "where is the station"}]
    with running_server(tiny_moe, batch=1, ctx_size=256, served_model_name="moe") as (url, state):
        first_prompt = encode_chat_prompt(tiny_moe.tokenizer, tiny_moe.chat_template.render(history))
        text, first = chat(url, history)
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "and the sea"}]
        prompt = prompt_ids(state, history)  # as the server makes it: the reply's span holds its generated ids
        _, second = chat(url, history)
        state.engine.cache.check_integrity()
    # What the cache holds after turn 1: its prompt and the reply's generated ids (a random model's reply
    # need not re-encode to the same ids, so the shared prefix is counted against what was generated).
    seen = first_prompt + _greedy(tiny_moe, first_prompt).token_ids
    not_shared = len(prompt) - common_prefix_len(prompt, seen)
    computed = second["prompt_tokens"] - second["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(prompt) - not_shared >= len(first_prompt)  # turn 1's whole prompt is shared at least
    assert not_shared <= computed <= not_shared + 1, (computed, not_shared, len(prompt))


def test_gpt_oss_harmony_reply_comes_back_as_reasoning_and_a_tool_call(tmp_path):
    """A forced call on a tiny random gpt-oss: the harmony grammar keeps its output in channel form, and the
    parser turns it into message.tool_calls (and reasoning_content for an analysis message, if any)."""
    write_tiny_moe_gguf(tmp_path / "h.gguf", "gpt-oss", seed=4, harmony=True, n_ctx=2048)
    loaded = open_model(str(tmp_path / "h.gguf"), fetch=False, max_positions=2048)
    tool = {"type": "function", "function": {"name": "ping", "description": "d",
                                             "parameters": {"type": "object", "properties": {},
                                                            "additionalProperties": False}}}
    body = {"model": "moe", "messages": [{"role": "user", "content": "ping the server"}], "temperature": 0,
            "max_tokens": 1500, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "ping"}}}
    with running_server(loaded, batch=1, ctx_size=2048, served_model_name="moe") as (url, state):
        assert state.protocol.tool_format.name == "harmony"
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", reply
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("ping", "{}")]
    # seed 4's greedy path writes an analysis message before the forced call: it arrives as reasoning
    assert choice["message"]["reasoning_content"] and choice["message"]["content"] is None
    assert "<|" not in choice["message"]["reasoning_content"]
