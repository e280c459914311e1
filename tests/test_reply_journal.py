"""The reply memory's file beside the disk tier (api/reply_journal.py): what a memory remembers comes back in a
new one, in the same order and bound; lines a crash cut are skipped; and through the server, a conversation held
on the disk tier is matched through its reply after a restart, as it was before it (issue 28)."""
from array import array

import httpx
import pytest

from api.reply_journal import ReplyJournal, journal_path
from api.reply_memory import GeneratedReply, ReplyMemory, prompt_key
from tests.support.server_harness import running_server
from tests.support.reply_model import FIRST, MAX_TOKENS, open_reply_model


def _reply(text, ids, splits=True):
    return GeneratedReply(text, array("l", ids), 2, len(ids) - 1, splits)


def _reopened(path, max_tokens=1000):
    memory = ReplyMemory(max_tokens)
    memory.attach_journal(ReplyJournal(path))
    return memory


def test_replies_remembered_come_back_from_the_file_in_their_order(tmp_path):
    path = journal_path(tmp_path, b"\1" * 16)
    memory = _reopened(path)
    memory.remember("", "prompt a", _reply("he", [5, 6]))
    memory.remember("", "prompt a", _reply("hi", [5, 7]))  # a retry: both kept, the newest first
    memory.remember("key:t|salt:", "prompt b", _reply("in", [8, 9, 10], splits=False))
    memory.close()
    again = _reopened(path)
    assert again.records() == memory.records() and again.num_tokens == 7
    assert [r.text for r in again.replies_for(prompt_key("", "prompt a"))] == ["hi", "he"]
    assert again.holds_salt("key:t|salt:") and not again.holds_salt("key:u|salt:")
    assert again.replies_for(prompt_key("", "prompt b")) == []  # another salt's prompt key
    assert again.stats["replies_loaded"] == 3 and again.stats["replies_remembered"] == 0
    assert "key:t" not in path.read_text()  # the salt (a tenant's API key) is kept as a digest
    again.close()


def test_a_line_cut_by_a_crash_is_skipped_and_the_bound_applies_on_load(tmp_path):
    path = journal_path(tmp_path, b"\2" * 16)
    memory = _reopened(path)
    for i in range(4):
        memory.remember("", f"prompt {i}", _reply(f"r{i}", [i + 1, i + 2]))
    memory.close()
    with open(path, "a") as f:
        f.write('{"k": "00", "s": "00", "m": 2, "t": "cut')  # what a crash mid-write leaves
    journal = ReplyJournal(path)
    small = ReplyMemory(max_tokens=4)
    small.attach_journal(journal)
    small.close()
    assert journal.skipped == 1 and small.num_tokens == 4  # the two newest of 4 x 2 ids
    assert [r.text for _, _, r in small.records()] == ["r2", "r3"]
    assert [r.text for _, _, r in ReplyJournal(path).read()] == ["r2", "r3"]  # rewritten with what was kept


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return open_reply_model(tmp_path_factory.mktemp("journal"))


def _chat(url, model, messages):
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    return reply["choices"][0]["message"]["content"], reply["usage"]


@pytest.mark.parametrize("keep_file", [True, False], ids=["with the file", "the file deleted"])
def test_after_a_restart_a_conversation_on_disk_is_matched_through_its_reply(lfm2, tmp_path, keep_file):
    """Turn one, a restart, turn two: with the file the match runs to the reply's end state (everything but
    its last token, never computed); without it, it ends before the reply (its text re-encodes merged)."""
    with running_server(lfm2, batch=1, ctx_size=512, conversation_cache_dir=str(tmp_path)) as (url, state):
        reply, first = _chat(url, state.served_name, FIRST)
    (path,) = tmp_path.glob("replies-*.jsonl")
    if not keep_file:
        path.unlink()
    follow_up = FIRST + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    with running_server(lfm2, batch=1, ctx_size=512, conversation_cache_dir=str(tmp_path)) as (url, state):
        _, second = _chat(url, state.served_name, follow_up)
        cache = httpx.get(url + "/cache", timeout=30).json()
        state.engine.cache.check_integrity()
    assert cache["replies"]["replies_loaded"] == (1 if keep_file else 0)
    if keep_file:
        assert second["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] + MAX_TOKENS - 1
        assert cache["replies"]["replies_kept_split_differently"] == 1
    else:
        assert second["prompt_tokens_details"]["cached_tokens"] <= first["prompt_tokens"]
