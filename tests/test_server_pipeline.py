"""The server with a layer split and batch groups, on the real model: the agent workload computes only what
is new, the stages show up in /pipeline, /slots and /metrics, and the disk tier survives a restart with a
different split (a cached block is the whole model's, whatever the stages)."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.served_workload import assert_ideal, chat, run_workload
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow


def test_a_three_stage_pipeline_with_one_slot_per_group_computes_only_what_is_new(smollm2):
    # The seeds' failing case: --batch N --batch-groups N (one slot per group) under a layer split.
    with running_server(smollm2, batch=2, batch_groups="2", layer_split="10,20", ctx_size=1024) as (url, state):
        checks = run_workload(url, state)
        pipeline = httpx.get(url + "/pipeline").json()
        slots = _slots_while_decoding(url)
        metrics = httpx.get(url + "/metrics").text
        state.engine.cache.check_integrity()
    assert_ideal(checks)
    assert [s["layers"] for s in pipeline["stages"]] == [[0, 9], [10, 19], [20, 29]]
    assert all(s["jobs"] > 0 and s["busy_seconds"] > 0 and s["queue_depth"] == 0 for s in pipeline["stages"])
    assert [g["group"] for g in pipeline["groups"]] == [0, 1]
    busy = [s for s in slots if s["state"] != "idle"]
    assert busy and all({"group", "pipeline_stage", "stage_queue_depth", "stage_busy_seconds"} <= s.keys()
                        for s in busy)
    assert 'strata_stage_busy_seconds_total{stage="2"}' in metrics and "strata_stage_queue_depth" in metrics


def _slots_while_decoding(url):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 40,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # decoding now
        slots = httpx.get(url + "/slots").json()
        for _ in lines:  # let it finish
            pass
    return slots


def test_the_disk_tier_is_shared_by_different_layer_splits(smollm2, tmp_path):
    messages = [{"role": "user", "content": "Write two sentences about lighthouses."}]
    with running_server(smollm2, batch=1, ctx_size=512, layer_split="15",
                        conversation_cache_dir=str(tmp_path)) as (url, _):
        reply, first = chat(url, messages)
    follow_up = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}]
    with running_server(smollm2, batch=1, ctx_size=512, layer_split="7,21",
                        conversation_cache_dir=str(tmp_path)) as (url, state):
        _, usage = chat(url, follow_up)
        state.engine.cache.check_integrity()
        loads = state.engine.cache.stats["disk_loads"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] and loads > 0


@pytest.mark.parametrize("layer_split, groups", [("10,20", "4"), ("15", "2")])
def test_four_concurrent_streams_through_the_pipeline_match_the_unpipelined_server(smollm2, layer_split, groups):
    prompts = ["Tell me about cats.", "What is 2+2?", "Write a haiku about rain.", "List some fruits."]

    def replies(**config):
        with running_server(smollm2, batch=4, ctx_size=1024, **config) as (url, _):
            def one(prompt):
                return chat(url, [{"role": "user", "content": prompt}], max_tokens=16)[0]

            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(one, prompts))

    assert replies(layer_split=layer_split, batch_groups=groups) == replies(batch_groups="1")
