"""A hybrid model's checkpoint hints inside messages (api/branch_hints.py): where a message's content starts,
where a blank line begins; and, through the server on the tiny qwen3next (a DeltaNet model resumes only at a
checkpoint), that a new prompt branching there first resumes exactly where it leaves the cached one."""
import httpx
import pytest

from api.branch_hints import (INTO_CONTENT, branch_hints, content_guesses, content_starts, into_content,
                               paragraph_starts)
from api.chat_turn import ChatTurn, render_turn
from api.tool_specs import normalise_tools
from engine.loader import encode_chat_prompt, open_model
from scheduler.cache.tree import common_prefix_len
from tests.support.server_harness import running_server
from tests.support.tiny_qwen3next import write_tiny_qwen3next

M, NL = 1, 10  # a message start token and a line end, in made-up ids


def test_content_starts_follow_the_role_header_line_of_each_message():
    ids = [M, 5, 6, NL, 7, 8, NL, NL, 9, M, 5, NL, 7, M, 5, 6]
    assert content_starts(ids, M, frozenset({NL})) == (4, 12)  # the last header has no line end
    assert content_starts([M, 5, M, 6, NL, 7], M, frozenset({NL})) == (5,)  # not past the next message's start
    assert content_starts([M, 5, NL], M, frozenset({NL})) == ()  # nothing after the header
    assert content_starts(ids, None, frozenset({NL})) == () and content_starts(ids, M, frozenset()) == ()


def test_paragraph_starts_are_where_a_blank_line_begins():
    ids = [5, NL, 6, NL, NL, NL, 7, NL, NL, 8, NL]
    assert paragraph_starts(ids, frozenset({NL})) == (4, 8)  # a run of blank lines counts once
    assert paragraph_starts([NL, NL, 5], frozenset({NL})) == (1,)
    assert paragraph_starts(ids, frozenset()) == () and paragraph_starts([NL], frozenset({NL})) == ()


def test_states_a_few_tokens_into_each_content_stay_inside_its_message():
    assert INTO_CONTENT == (8, 16)
    ids = [M, 5, NL] + [7] * 20 + [M, 5, NL] + [7] * 10 + [M, 5, NL]
    assert into_content((3, 26), M, ids) == (11, 19, 34)  # 26 + 16 is past the prompt's third message start
    assert into_content((3,), M, [M, 5, NL] + [7] * 8) == ()  # 3 + 8 is the prompt's end
    assert into_content((), M, ids) == ()


def test_branch_hints_join_message_content_and_paragraph_starts():
    ids = [M, 5, 6, NL, 7, 8, NL, NL, 9, M, 5, NL, 7, M, 5, NL]
    assert branch_hints(ids, M, frozenset({NL})) == (4, 7, 9, 12, 13)
    ids = [M, 5, NL] + [7] * 20 + [M, 5, NL]
    assert branch_hints(ids, M, frozenset({NL})) == (3, 23)
    assert content_guesses(ids, M, frozenset({NL})) == (11, 19)  # not branch points: given up first
    assert branch_hints(ids, None, frozenset()) == ()


@pytest.fixture(scope="module")
def qwen3next(tmp_path_factory):
    path = tmp_path_factory.mktemp("hints") / "tiny-qwen3next.gguf"
    write_tiny_qwen3next(path, seed=5, n_ctx=1024)
    return open_model(str(path), max_positions=1024)


def _prompt_ids(state, messages):
    return encode_chat_prompt(state.loaded.tokenizer, render_turn(state, ChatTurn(messages, normalise_tools(None))))


SYSTEM = "Rules:\n- be brief\n- be kind\n\nAnswer the question."


@pytest.mark.parametrize("first, second", [
    ([{"role": "user", "content": "Tell me a story."}], [{"role": "user", "content": "Quick: 2 plus 2?"}]),
    ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}],
     [{"role": "system", "content": SYSTEM.replace("kind\n", "kind\n- be right\n")}, {"role": "user", "content": "Hi."}]),
    ([{"role": "user", "content": "Tell me about the history of Rome."}],
     [{"role": "user", "content": "Tell me about how plants make food."}]),
], ids=["a new conversation", "a list that grows", "another question of the same form"])
def test_a_prompt_that_first_branches_at_a_content_or_paragraph_start_resumes_there(qwen3next, first, second):
    """The second prompt leaves the first where a message's content begins (after `<|im_start|>user\\n`),
    where the first's list ends at its blank line, or 12 tokens into the content ("Tell me about the" /
    "how"): it reuses the tokens they share up to the checkpoint the first request took there or 8 tokens
    into the content (before: from the start)."""
    # a pool with room for all of the first prompt's states (one is 5 K/V blocks here)
    with running_server(qwen3next, batch=1, ctx_size=1024, state_checkpoint_every="0") as (url, state):
        a, b = _prompt_ids(state, first), _prompt_ids(state, second)
        hints = branch_hints(a, state.message_start_id, state.line_end_ids) \
            + content_guesses(a, state.message_start_id, state.line_end_ids)
        shared = a[: common_prefix_len(a, b)]
        branch = max(h for h in hints if h <= len(shared))
        assert len(shared) - branch < 8
        for messages in (first, second):
            body = {"model": state.served_name, "messages": messages, "max_tokens": 2, "temperature": 0}
            usage = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["usage"]
        assert usage["prompt_tokens"] == len(b) and usage["prompt_tokens_details"]["cached_tokens"] == branch > 0
        cache = httpx.get(url + "/cache", timeout=30).json()
        # the K/V matched further than the state: the miss is counted (and logged) as one for want of a checkpoint
        assert cache["checkpoints_restored"] == 1 and cache.get("miss_no_checkpoint", 0) == (branch < len(shared))
        state.engine.cache.check_integrity()
