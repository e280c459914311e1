"""GET /dashboard and the /requests it reads: two named conversations of two turns each on SmolLM2, the second
of one with an edited system prompt (a miss the cache explains), then the JSON checked against the replies'
usage, the API key's reach, and the page rendered in headless Chromium (installed by scripts/test.sh)."""
from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import pytest

from tests.support.server_harness import running_server

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _chat(url: str, conversation: str, messages: list[dict]) -> dict:
    reply = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=600, json={
        "model": "smollm2", "messages": messages, "max_tokens": 6, "temperature": 0,
        "prompt_cache_key": conversation})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _two_turns(url: str, conversation: str, system: str, question: str, edited_system: str | None = None) -> list:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    first = _chat(url, conversation, messages)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And why?"}]
    if edited_system is not None:
        messages[0] = {"role": "system", "content": edited_system}
    return [first["usage"], _chat(url, conversation, messages)["usage"]]


@pytest.fixture(scope="module")
def served(smollm2):
    """(url, {conversation: [usage of turn 1, usage of turn 2]}) of a keyed server after the four turns."""
    with running_server(smollm2, api_key=KEY, batch=1, ctx_size=1024) as (url, _):
        usages = {"agent-alpha": _two_turns(url, "agent-alpha", "You are a helpful assistant. " * 12,
                                            "What is the capital of France?"),
                  "agent-beta": _two_turns(url, "agent-beta", "You write Python code. " * 12, "Say hello.",
                                           edited_system="You write Python code. " * 6 + "You write C. " * 6)}
        yield url, usages


def test_requests_show_each_turns_reuse_as_the_reply_reported_it(served):
    url, usages = served
    for conversation, turns in usages.items():
        found = httpx.get(f"{url}/requests", params={"conversation": conversation}, headers=AUTH).json()["requests"]
        assert [r["conversation"] for r in found] == [conversation, conversation]
        for record, usage in zip(reversed(found), turns):  # newest first
            assert record["prompt_tokens"] == usage["prompt_tokens"]
            assert record["reused_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
            assert record["computed_tokens"] == usage["prompt_tokens"] - record["reused_tokens"]
            assert record["generated_tokens"] == usage["completion_tokens"]
            assert 0 < record["ttft_ms"] <= record["total_ms"]
    alpha = usages["agent-alpha"]
    assert alpha[1]["prompt_tokens_details"]["cached_tokens"] >= alpha[0]["prompt_tokens"]  # the whole first turn


def test_an_edited_system_prompt_is_an_explained_miss(served):
    url, usages = served
    second = httpx.get(f"{url}/requests", params={"conversation": "agent-beta", "limit": 1},
                       headers=AUTH).json()["requests"]
    assert len(second) == 1
    miss = second[0]["miss"]
    assert miss["cause"] == "diverged" and miss["where"] == "message 0 (system)"
    assert miss["position"] == usages["agent-beta"][1]["prompt_tokens_details"]["cached_tokens"]
    newest = httpx.get(f"{url}/requests", headers=AUTH).json()["requests"]
    assert [r["conversation"] for r in newest] == ["agent-beta", "agent-beta", "agent-alpha", "agent-alpha"]


def test_requests_refuses_a_bad_limit(served):
    url, _ = served
    reply = httpx.get(f"{url}/requests", params={"limit": "0"}, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "limit"


def test_the_page_is_open_and_its_data_needs_the_key(served):
    url, _ = served
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # nothing loaded from elsewhere
    for path in ("/requests", "/cache", "/slots", "/v1/models"):
        assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + path, headers=AUTH).status_code == 200, path


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _rendered(url: str) -> str:
    """The page's DOM after its script ran and fetched its data, from headless Chromium."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium here (scripts/test.sh installs Debian's chromium package)")
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=8000", "--dump-dom", f"{url}/dashboard#key={KEY}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _row_texts(dom: str, table_id: str) -> list[str]:
    table = re.search(rf'<table id="{table_id}">(.*?)</table>', dom, re.S)
    assert table, f"no table {table_id} in the rendered page"
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(1), re.S)
    return [" | ".join(re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S))
            for row in rows]


def test_headless_chromium_shows_both_conversations_their_reuse_and_the_miss(served):
    url, usages = served
    dom = _rendered(url)
    assert re.search(r'id="status"[^>]*>updated ', dom), "the page's script did not finish a refresh"
    conversations = _row_texts(dom, "conversations")[1:]
    for key, turns in usages.items():
        row = next(r for r in conversations if r.startswith(key + " |"))
        last = turns[1]
        assert f"{last['prompt_tokens_details']['cached_tokens']} / {last['prompt_tokens']}" in row
        assert "| 2 |" in row  # turns
    requests = _row_texts(dom, "requests")[1:]
    assert len(requests) == 4
    beta_second = requests[0]
    assert beta_second.split(" | ")[1] == "agent-beta"
    assert re.search(r"diverged at token \d+, in message 0 \(system\) from conv-", beta_second)
