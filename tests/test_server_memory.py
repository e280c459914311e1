"""Blocks as tokens arrive, through the API on the real model: --batch 8 with a KV pool that holds only
3 worst cases (prompt + the rest of the context each) serves 8 concurrent streams sent without max_tokens,
preempting by parking and resuming by restore, so no conversation is ever re-read."""
import concurrent.futures

import httpx
import pytest

from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow
CTX = 128  # a worst case is 8 blocks of 16 tokens; 3 of them are 24 blocks (kv_cache_mib 17, f32 K/V, SmolLM2)


def _stream(url, i):
    body = {"model": "smollm2", "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Write a long story about lighthouse number {i}."}]}
    chunks = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
    return chunks


def test_batch_8_on_a_pool_of_3_worst_cases_serves_8_streams_at_once(smollm2):
    with running_server(smollm2, batch=8, ctx_size=CTX, kv_cache_mib=17, kv_type="f32") as (url, state):
        engine = state.engine
        assert engine.cache.num_blocks == 24  # 3 worst cases of 8 blocks
        most = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_stream, url, i) for i in range(8)]
            while not all(f.done() for f in futures):
                most.append(sum(s is not None for s in engine.table.slots))
                concurrent.futures.wait(futures, timeout=0.05)
            counts = [f.result() for f in futures]
        engine.cache.check_integrity()
    assert all(c > 1 for c in counts) and max(most) == 8  # all eight ran together, none refused
    assert engine.num_preemptions > 0 and engine.recomputed_tokens == 0  # preempted, never re-read
