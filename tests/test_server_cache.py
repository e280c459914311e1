"""Conversation workloads through the API on the real model: every turn computes only what is new.

For each request, `computed = prompt_tokens - cached_tokens` must be the tokens its prompt does not share
with any earlier prompt + reply of the run, plus at most the one token whose KV is never computed (the
last token of a reply cut by max_tokens). Checked with ample memory and with a device pool so small that
every turn parks the other conversations in host RAM and restores its own.
"""
import dataclasses

import httpx
import pytest

from engine.chat_template import ChatTemplate
from engine.loader import encode_chat_prompt
from tests.support.served_workload import assert_ideal, chat, run_workload
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow


def test_alternating_conversations_with_short_requests_compute_only_what_is_new(smollm2):
    with running_server(smollm2, batch=2, ctx_size=1024) as (url, state):
        checks = run_workload(url, state)
        state.engine.cache.check_integrity()
    assert_ideal(checks)
    assert sum(c for c, _, _ in checks) < 0.5 * sum(n for _, _, n in checks)  # most of every prompt reused


def test_a_tiny_device_pool_spills_to_host_ram_and_still_computes_only_what_is_new(smollm2):
    with running_server(smollm2, batch=1, ctx_size=256, kv_cache_mib=1) as (url, state):
        checks = run_workload(url, state)
        usage = httpx.get(url + "/cache").json()
        metrics = httpx.get(url + "/metrics").text
        state.engine.cache.check_integrity()
    assert_ideal(checks)
    assert usage["parks"] > 0 and usage["restores"] > 0 and usage["dropped_blocks"] == 0
    assert usage["moves"]["park"]["count"] == usage["parks"] and usage["moves"]["park"]["bytes"] > 0
    assert 'strata_cache_moves_total{op="park"}' in metrics and "strata_cache_move_seconds_total" in metrics


def test_cache_salts_and_tenant_keys_never_share_cached_tokens(smollm2):
    messages = [{"role": "user", "content": "Name a color."}]
    body = {"model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": 2}
    with running_server(smollm2, batch=1, ctx_size=256, api_key="alice,bob") as (url, _):
        def cached(key, **extra):
            reply = httpx.post(url + "/v1/chat/completions", json={**body, **extra},
                               headers={"Authorization": f"Bearer {key}"}, timeout=60).json()
            return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("alice") == 0
        assert cached("alice") > 0  # same tenant: reused
        assert cached("bob") == 0  # other tenant: nothing shared
        assert cached("alice", cache_salt="s1") == 0  # own salt: a separate namespace
        assert cached("alice", cache_salt="s1") > 0


def test_toggling_tool_lists_hit_both_variants(smollm2):
    """An agent whose tool list at the head of the prompt toggles between two versions (seed report 003)."""
    tools = [[{"type": "function", "function": {"name": f"tool_{i}", "description": "d", "parameters": {}}}
              for i in range(n)] for n in (2, 4)]
    template = ("<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% for m in messages %}<|im_start|>"
                "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    with_tools = dataclasses.replace(smollm2, chat_template=ChatTemplate(template, "test"))
    history = [{"role": "user", "content": "List the files in the current folder, please."}]
    computed, prompts = [], []
    with running_server(with_tools, batch=1, ctx_size=1024) as (url, _):
        for turn in range(6):
            body = {"model": "smollm2", "messages": history, "tools": tools[turn % 2], "temperature": 0,
                    "max_tokens": 4}
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
            usage = reply["usage"]
            computed.append(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"])
            prompts.append(usage["prompt_tokens"])
            history = history + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                                 {"role": "user", "content": f"And now step {turn + 2}."}]
    assert prompts[1] != prompts[0]  # the two tool lists really render differently
    # from the third turn on, each variant's head and the shared conversation come from the cache: only
    # the last two turns' messages are new (nothing near a full re-read of the prompt)
    assert all(c < 60 for c in computed[2:]), (computed, prompts)


def test_compaction_that_drops_old_messages_reuses_the_kept_head(smollm2):
    """An agent that compacts: drops the middle of the conversation and keeps the system prompt + recent
    turns. Everything up to the first dropped message is reused; the rest is new content."""
    system = {"role": "system", "content": "You are a careful coding agent. Follow the instructions."}
    history = [system] + [m for i in range(3) for m in (
        {"role": "user", "content": f"Step {i}: read file number {i} and summarise it."},
        {"role": "assistant", "content": f"File {i} defines a parser and two helpers."})]
    with running_server(smollm2, batch=1, ctx_size=1024) as (url, _):
        chat(url, history + [{"role": "user", "content": "Continue."}])
        compacted = [system, history[-2], history[-1], {"role": "user", "content": "Continue."}]
        _, usage = chat(url, compacted)
    head = encode_chat_prompt(smollm2.tokenizer, smollm2.chat_template.render([system], add_generation_prompt=False))
    prompt = encode_chat_prompt(smollm2.tokenizer, smollm2.chat_template.render(compacted))
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert len(head) <= cached < len(prompt) - 10  # the head (and what follows it identically) is reused


def test_the_cache_survives_a_server_restart_with_a_disk_tier(smollm2, tmp_path):
    messages = [{"role": "user", "content": "Write two sentences about lighthouses."}]
    with running_server(smollm2, batch=1, ctx_size=512, conversation_cache_dir=str(tmp_path)) as (url, _):
        reply, first = chat(url, messages)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    follow_up = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}]
    with running_server(smollm2, batch=1, ctx_size=512, conversation_cache_dir=str(tmp_path)) as (url, state):
        _, usage = chat(url, follow_up)
        tiers = state.engine.cache.stats
    assert usage["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"]  # prompt + reply from disk
    assert tiers["disk_loads"] > 0
