"""The tiny hybrid models (lfm2: short convs + attention; qwen3next: gated DeltaNet + gated attention + MoE)
and the engine loop that plays conversation turns through them with the integrity check after every admission
and step: shared by tests/test_hybrid_cache.py and the checkpoint and state-window tests beside it."""
import asyncio

import numpy as np

from engine.backends.reference.backend import NumpyBackend
from engine.gguf_file import GGUFFile
from engine.model import load_model
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from engine.tokenizer import Tokenizer
from scheduler.cache.disk_tier import DiskTier, cache_key
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from tests.support.tiny_lfm2 import write_tiny_lfm2
from tests.support.tiny_qwen3next import write_tiny_qwen3next
from tests.support.turn_workloads import HEAD_LEN, HEAD_SWAP, ideal_computed

BLOCK = 4
# The state window's bounds, measured on the tiny lfm2 of tests/test_state_window.py (max over rows / the largest
# logit): 2.9e-7 for the logits, 1.0e-5 absolute on conv states of magnitude ~10; the bounds leave 30x and 10x
# room for other BLAS builds.
LOGIT_BOUND, STATE_BOUND = 1e-5, 1e-4
# qwen3next's DeltaNet layers at a size whose state (a checkpoint) costs one block of 4 tokens, as lfm2's does
WRITERS = {"lfm2": lambda path: write_tiny_lfm2(path, seed=4, n_ctx=1024),
           "qwen3next": lambda path: write_tiny_qwen3next(path, seed=4, n_ctx=1024, n_k_heads=1, n_v_heads=2,
                                                          k_head_dim=4, v_head_dim=4)}


def open_hybrid(name: str, directory):
    """(model, tokenizer) of the tiny `name` (a key of WRITERS), written into `directory`, on numpy."""
    path = directory / f"tiny-{name}.gguf"
    WRITERS[name](path)
    return load_model(path, NumpyBackend())[0], Tokenizer.from_gguf_fields(GGUFFile(path).fields)


def disk_tier(root, runner, blocks):
    """A disk tier of `blocks` blocks under `root` for the runner's layout."""
    lay = runner.layout
    return DiskTier(root, cache_key("tiny-lfm2", (BLOCK,)), (lay.n_layers, lay.n_kv_heads, BLOCK, lay.head_dim),
                    "float32", blocks)


def run_turns(hybrid, turns, cache_on=True, num_blocks=400, host_blocks=0, disk_root=None, disk_blocks=256, every=2,
              concurrency=1, history=None, chunk=8, hints=None, on_start=None, layer_split=(), groups=1,
              write_behind_mib_s=0.0, guesses=None):
    """Turns [(conversation, new user tokens, reply length)] through one engine loop. Returns (replies,
    [(prompt_len, cached, ideal)], per step [(request id, tokens computed, logits row, block table)], the loop,
    the conversations' histories)."""
    model, tokenizer = hybrid
    history = {} if history is None else history
    steps, out = [], {}

    async def main():
        runner = ModelRunner(model, num_blocks, BLOCK, host_blocks=host_blocks, layer_split=layer_split)
        disk = disk_tier(disk_root, runner, disk_blocks) if disk_root is not None else None
        loop = EngineLoop(runner, tokenizer, num_slots=3, prefill_chunk=chunk, max_queue=64, prefix_cache=cache_on,
                          integrity_checks=True, disk=disk, state_checkpoint_every=every, batch_groups=groups,
                          write_behind_mib_s=write_behind_mib_s)
        finish = loop.pipeline.finish

        def recording_finish(work, logits):
            steps.extend((r.request_id, n, np.array(logits[i]), list(r.seq.block_table))
                         for i, (r, n) in enumerate(work))
            return finish(work, logits)

        loop.pipeline.finish = recording_finish
        loop.start()
        if on_start is not None:
            on_start(loop)
        replies, usage, cached = [], [], [h[:-1] for h in history.values()]
        for start in range(0, len(turns), concurrency):
            batch, streams = turns[start : start + concurrency], []
            for i, (conv, user, reply_len) in enumerate(batch):
                past = history.get(conv, [])
                if user and user[0] == HEAD_SWAP:  # the head toggles (tests/support/turn_workloads.py)
                    past, user = user[1 : HEAD_LEN + 1] + past[HEAD_LEN:], user[HEAD_LEN + 1 :]
                prompt = past + user
                params = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
                request = Request(f"t{start + i}", prompt, params,
                                  checkpoint_positions=(hints or {}).get(start + i, ()),
                                  checkpoint_guesses=(guesses or {}).get(start + i, ()))
                streams.append((conv, prompt, loop.submit(request)))
            for conv, prompt, stream in streams:
                tokens, last = [], None
                async for delta in stream:
                    tokens += delta.token_ids
                    last = delta
                replies.append(tokens)
                usage.append((len(prompt), last.usage.cached_tokens, ideal_computed(prompt, cached)))
            for (conv, prompt, _), tokens in zip(streams, replies[-len(batch):]):
                history[conv] = prompt + tokens
                cached.append(prompt + tokens[:-1])  # the reply's last token is never computed
        await loop.shutdown(1)
        out.update(replies=replies, usage=usage, loop=loop)

    asyncio.run(main())
    return out["replies"], out["usage"], steps, out["loop"], history
