"""The routes a router probes, in the shapes SGLang's router reads (api/worker_info.py); the real router
reads them in tests/test_router_worker.py, this checks them where that router cannot be installed."""
import asyncio

import httpx
import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from tests.support.server_harness import running_server


@pytest.mark.slow
def test_server_and_model_info_name_the_served_model_in_both_spellings(smollm2):
    with running_server(smollm2, batch=2, ctx_size=512, served_model_name="smol") as (url, state):
        for path in ("/server_info", "/get_server_info"):
            info = httpx.get(url + path).json()
            assert info["served_model_name"] == "smol" and info["model_path"] == str(smollm2.path)
            assert info["max_running_requests"] == 2 and info["context_length"] == 512 and info["dp_size"] == 1
            assert info["max_total_tokens"] == state.engine.cache.num_blocks * state.engine.runner.block_size
        for path in ("/model_info", "/get_model_info"):
            info = httpx.get(url + path).json()
            assert info["is_generation"] is True and info["model_type"] == "llama"
            assert info["architectures"] == ["LlamaForCausalLM"] and info["tokenizer_path"] is None


def test_load_counts_waiting_prompts_then_the_blocks_an_admitted_request_holds(load_tiny):
    model, tokenizer = load_tiny("llama", seed=2, n_ctx=256)
    loop = EngineLoop(ModelRunner(model, 64, 4), tokenizer, num_slots=1, prefill_chunk=16, max_queue=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def main():
        loop.submit(Request("r1", list(range(3, 13)), params))  # 10 tokens
        loop.submit(Request("r2", list(range(3, 10)), params))  # 7 tokens
        before = loop.load_snapshot()
        loop.admit()  # one slot: r1 runs, holding blocks for its first chunk (10 tokens -> 3 blocks of 4)
        return before, loop.load_snapshot()

    before, after = asyncio.run(main())
    assert before == {"running": 0, "waiting": 2, "tokens": 17}
    assert after == {"running": 1, "waiting": 1, "tokens": 3 * 4 + 7}


@pytest.mark.slow
def test_get_load_answers_one_rank_in_sglang_shape(server):
    url, _ = server  # idle between tests: nothing running or waiting
    assert httpx.get(url + "/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


@pytest.mark.slow
def test_worker_info_answers_without_the_api_key_like_health(smollm2):
    with running_server(smollm2, batch=1, ctx_size=512, api_key="k") as (url, _):
        for path in ("/server_info", "/model_info", "/get_load"):
            assert httpx.get(url + path).status_code == 200
        assert httpx.get(url + "/slots").status_code == 401  # the rest still needs it


def test_conversation_name_prefers_the_body_then_the_routing_key_then_x_conversation_id():
    from api.turn_runner import conversation_name

    both = {"x-smg-routing-key": "route-1", "x-conversation-id": "conv-1"}
    assert conversation_name("pck", both) == "pck"  # prompt_cache_key / Claude Code's session id
    assert conversation_name(None, both) == "route-1"
    assert conversation_name(None, {"x-conversation-id": "conv-1"}) == "conv-1"
    assert conversation_name(None, {"x-smg-routing-key": ""}) is None


@pytest.mark.slow
def test_a_responses_turn_named_only_by_the_routers_header_is_tracked_under_it(server):
    # what reaches a replica from sglang-router: the routing key header, prompt_cache_key dropped from the body
    url, state = server
    before = {c["key"] for c in state.engine.conversations.snapshot()}  # the shared server's earlier tests'
    body = {"model": "smollm2", "input": "Say hi.", "max_output_tokens": 2, "store": False}
    reply = httpx.post(url + "/v1/responses", json=body, headers={"X-SMG-Routing-Key": "codex-7"}, timeout=120)
    assert reply.status_code == 200
    assert [c["key"] for c in state.engine.conversations.snapshot() if c["key"] not in before] == ["codex-7"]
