"""A two-conversation chat workload through a running server (tests/support/server_harness.py) and the
check that each of its turns computed only what no earlier prompt + reply of the run shared: used by
tests/test_server_cache.py, test_server_pipeline.py and test_server_moe.py."""
import httpx

from api.chat_turn import ChatTurn, encode_turn, render_turn
from api.tool_specs import normalise_tools
from scheduler.cache.tree import common_prefix_len


def chat(url, messages, max_tokens=12):
    """(reply text, usage) of a greedy chat completion."""
    body = {"model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    return reply["choices"][0]["message"]["content"], reply["usage"]


def prompt_ids(state, messages, add_generation_prompt=True):
    """The prompt ids the server makes of these messages: rendered, the replies it generated kept as generated."""
    turn = ChatTurn(messages, normalise_tools(None), add_generation_prompt=add_generation_prompt)
    return encode_turn(state, turn, render_turn(state, turn), "").ids


def run_workload(url, state):
    """Two conversations alternating, with a short unrelated request between turns."""
    history = {"a": [{"role": "user", "content": "Tell me about the history of Rome."}],
               "b": [{"role": "user", "content": "How do plants make food from sunlight?"}]}
    seen, checks = [], []

    def run(messages):
        prompt = prompt_ids(state, messages)
        text, usage = chat(url, messages)
        assert usage["prompt_tokens"] == len(prompt)
        shared = max((common_prefix_len(prompt, s) for s in seen), default=0)
        computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        checks.append((computed, len(prompt) - shared, len(prompt)))
        # the prompt and its reply as the next prompt that carries it has them (the generated ids)
        answered = prompt_ids(state, messages + [{"role": "assistant", "content": text}], add_generation_prompt=False)
        seen.append(answered[:usage["prompt_tokens"] + usage["completion_tokens"]])
        return text

    for turn in range(3):
        for name in ("a", "b"):
            text = run(history[name])
            history[name] += [{"role": "assistant", "content": text},
                              {"role": "user", "content": f"Tell me more, part {turn + 2}."}]
        run([{"role": "user", "content": f"Quick question {turn}: what is 2 plus 2?"}])
    return checks


def assert_ideal(checks):
    """Each turn of run_workload computed what no earlier prompt + reply shared, plus at most one token."""
    for computed, not_shared, _ in checks:
        assert not_shared <= computed <= not_shared + 1, checks
