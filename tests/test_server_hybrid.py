"""A hybrid model (tiny lfm2, tiny qwen3next) through the HTTP API: the next turn of a conversation reuses the
previous turn's prompt and reply from a state checkpoint, and /cache reports the checkpoints and their bytes."""
import httpx
import pytest

from engine.loader import open_model
from tests.support.server_harness import running_server
from tests.support.tiny_gguf import tiny_vocab
from tests.support.tiny_lfm2 import write_tiny_lfm2
from tests.support.tiny_qwen3next import write_tiny_qwen3next

OUTPUT_TEXT = "0123456789ABCDEF"  # tokens whose text re-encodes to themselves (no merges, valid UTF-8)


def _chat(url, model, messages):
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 8}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    return reply["choices"][0]["message"]["content"], reply["usage"]


@pytest.mark.parametrize("writer", [write_tiny_lfm2, write_tiny_qwen3next], ids=["lfm2", "qwen3next"])
def test_the_next_turn_reuses_the_last_one_from_a_checkpoint(tmp_path, writer):
    tokens = tiny_vocab()[0]
    path = tmp_path / "tiny-hybrid.gguf"
    writer(path, seed=5, n_ctx=1024, output_ids=[tokens.index(c) for c in OUTPUT_TEXT])
    loaded = open_model(str(path), max_positions=1024)
    with running_server(loaded, batch=2, ctx_size=512) as (url, state):
        messages = [{"role": "system", "content": "Answer in digits."}, {"role": "user", "content": "How many?"}]
        reply, first = _chat(url, state.served_name, messages)
        assert len(reply) == 8 and set(reply) <= set(OUTPUT_TEXT)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        _, second = _chat(url, state.served_name, messages)
        # Everything but the reply's last token, which is sampled and never computed.
        assert second["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] + 8 - 1
        cache = httpx.get(url + "/cache", timeout=30).json()
    assert cache["checkpoints_device"] >= 2 and cache["checkpoints_restored"] == 1
    assert cache["checkpoint_bytes_device"] == cache["checkpoints_device"] * cache["checkpoint_state_bytes"] > 0
