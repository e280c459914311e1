"""lfm2 (short convolutions + attention) on the CUDA backend against the numpy backend on the tiny lfm2 GGUF:
logits and greedy ids through chunked prefill and decode, continuous batching with a state row per sequence,
a layer split, and the recurrent-state interface the conversation cache checkpoints through (read, write,
states captured inside a chunk), then whole turns through the engine loop with the cache on.

Each runs on a GPU (marked `cuda`), on the numpy twins (tests/support/fake_cuda.py) and on the kernel sources under g++
(tests/support/fake_cuda_emulated.py: short_conv.cu, mul_f32 and the rest), through the `cuda` fixture of
tests/conftest.py.
"""
import asyncio

import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.gguf_file import GGUFFile
from engine.model import load_model
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner, Sequence
from engine.tokenizer import Tokenizer
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from tests.support.cuda_backend_checks import GEMM, REDUCE, assert_close, launch_log
from tests.support.tiny_lfm2 import write_tiny_lfm2

BLOCK = 4
PROMPT = [(5 * i) % 90 + 10 for i in range(23)]


@pytest.fixture
def models(cuda, tmp_path):
    """(cuda model, numpy model) of one tiny lfm2 (pattern c c a c a c: conv layers on both sides of a split)."""
    write_tiny_lfm2(tmp_path / "lfm2.gguf", seed=4, n_ctx=256)
    return load_model(tmp_path / "lfm2.gguf", cuda)[0], load_model(tmp_path / "lfm2.gguf", NumpyBackend())[0]


def _prefill_and_decode(model, ids, steps, chunk, layer_split=()):
    """(logits of every step's rows, greedy ids): ids in chunks, then `steps` greedy tokens one a step."""
    runner = ModelRunner(model, num_blocks=32, block_size=BLOCK, layer_split=layer_split)
    seq = Sequence(list(ids))
    runner.ensure_blocks(seq, len(ids) + steps)
    rows = []
    while seq.num_pending:
        rows.append(runner.step([(seq, min(chunk, seq.num_pending))], all_logits=True))
    greedy = []
    for _ in range(steps):
        greedy.append(int(np.argmax(rows[-1][-1])))
        seq.token_ids.append(greedy[-1])
        rows.append(runner.step([(seq, 1)], all_logits=True))
    return np.concatenate(rows), greedy


@pytest.mark.parametrize("chunk, split", [(5, ()), (23, (3,))])
def test_logits_and_greedy_ids_equal_numpy(models, chunk, split):
    """Up to 8 rows a step go through the fp32 matvec; a 23-row prefill through the gemm, whose fp16 operands
    (docs/CUDA_KERNELS.md) leave the logits within GEMM's bound, not float32 round-off."""
    cuda_model, numpy_model = models
    got, got_ids = _prefill_and_decode(cuda_model, PROMPT, 8, chunk, split)
    want, want_ids = _prefill_and_decode(numpy_model, PROMPT, 8, chunk, split)
    assert_close(got, want, REDUCE if chunk <= 8 else GEMM)
    assert got_ids == want_ids
    log = launch_log(cuda_model.backend)
    assert log is None or {"short_conv_f32", "mul_f32"} <= set(log)


def test_batched_sequences_keep_their_own_state_rows(models):
    """Sequences joining at different steps, prefill beside decode, more sequences than the pool's first
    four state rows (the device pool grows, keeping the rows it had). Steps of 8 rows: the fp32 matvec."""
    outs = []
    for model in models:
        runner = ModelRunner(model, num_blocks=64, block_size=BLOCK)
        seqs = [Sequence(list(range(10 + i, 24 + i))) for i in range(6)]
        for seq in seqs:
            runner.ensure_blocks(seq, len(seq.token_ids))
        rows = [runner.step([(seqs[0], 5), (seqs[1], 3)])]
        rows.append(runner.step([(seqs[0], 1), (seqs[1], 4), (seqs[2], 3)]))
        rows.append(runner.step([(seqs[2], 1), (seqs[3], 5), (seqs[4], 2)]))
        rows.append(runner.step([(seqs[4], 1), (seqs[5], 6), (seqs[0], 1)]))
        outs.append(np.concatenate(rows))
    assert_close(outs[0], outs[1], REDUCE)


def test_a_state_read_and_written_back_resumes_as_numpy(models):
    """The checkpoint round trip the cache relies on: read the state after 8 tokens on CUDA, load it into a
    fresh sequence over the same blocks, and its next logits are numpy's; the state itself equals numpy's."""
    states, logits = [], []
    for model in models:
        runner = ModelRunner(model, num_blocks=32, block_size=BLOCK)
        seq = Sequence(list(PROMPT[:16]))
        runner.ensure_blocks(seq, 16)
        runner.step([(seq, 8)])
        state = runner.states.read(seq)
        resumed = Sequence(list(PROMPT[:16]), block_table=list(seq.block_table), num_computed=8)
        runner.states.write(resumed, state)
        assert resumed.state_slot != seq.state_slot
        np.testing.assert_array_equal(runner.states.read(resumed), state)  # written exactly
        states.append(state)
        logits.append(runner.step([(resumed, 8)], all_logits=True))
    assert_close(states[0], states[1], REDUCE)
    assert_close(logits[0], logits[1], REDUCE)


def test_states_captured_inside_a_chunk_equal_numpy(models):
    """Checkpoints inside 8-token chunks: at 7 (one row from the previous state), 12 and 14 (the chunk's end),
    and at 1 and 2 of a first chunk (rows of the zero state)."""
    captured = []
    for model in models:
        runner = ModelRunner(model, num_blocks=32, block_size=BLOCK, layer_split=(2,))
        seq = Sequence(list(PROMPT[:14]))
        runner.ensure_blocks(seq, 14)
        runner.step([(seq, 6)])
        runner.states.capture(seq, (7, 12, 14))
        runner.step([(seq, 8)])
        got = runner.states.take_captured(seq)
        np.testing.assert_array_equal(got[14], runner.states.read(seq))
        fresh = Sequence(list(PROMPT[:8]))
        runner.ensure_blocks(fresh, 8)
        runner.states.capture(fresh, (1, 2))
        runner.step([(fresh, 8)])
        got |= {-p: s for p, s in runner.states.take_captured(fresh).items()}
        assert runner.states.take_captured(seq) == {}
        captured.append(got)
    assert sorted(captured[0]) == sorted(captured[1]) == [-2, -1, 7, 12, 14]
    for position in captured[1]:
        assert_close(captured[0][position], captured[1][position], REDUCE)


def _window_step(model, position: int = 15, new: int = 2):
    """A reference sequence computes PROMPT[:position] in chunks of 5; a second one gets byte copies of its
    blocks, zero states and the 6-token state window (engine/state_window.py), then `new` tokens in one step
    (8 rows: the fp32 matvec) capturing the state at `position`. (reference state, window state, the step's
    logits, the copied blocks before and after)."""
    runner = ModelRunner(model, num_blocks=32, block_size=BLOCK)
    ref, win = Sequence(list(PROMPT)), Sequence(list(PROMPT))
    runner.ensure_blocks(ref, len(PROMPT))
    runner.ensure_blocks(win, len(PROMPT))
    while ref.num_computed < position:
        runner.step([(ref, min(5, position - ref.num_computed))])
    used = -(-position // BLOCK)
    for a, b in zip(ref.block_table[:used], win.block_table[:used]):
        runner.write_block(b, *runner.read_block("device", a))
    before = [runner.read_block("device", b) for b in win.block_table[:used]]
    win.num_computed = position
    runner.states.start_window(win)
    assert win.state_window == 6 == runner.states.window_tokens
    runner.states.capture(win, (position,))
    logits = runner.step([(win, new)], all_logits=True)
    after = [runner.read_block("device", b) for b in win.block_table[:used]]
    return runner.states.read(ref), runner.states.take_captured(win)[position], logits, before, after


def test_a_state_window_recomputes_the_state_and_writes_no_k_v_as_numpy(models):
    """The window's rows write no K/V on CUDA (store_kv's slot -1: the blocks before the window's end keep
    their bytes), the state it recomputes is the reference's, and the step's logits are numpy's."""
    outs = [_window_step(model) for model in models]
    for ref_state, state, _, before, after in outs:
        assert_close(state, ref_state, REDUCE)
        for block, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
            keys = slice(0, min(BLOCK, 15 - block * BLOCK))  # positions < 15 only
            np.testing.assert_array_equal(k1[:, :, keys], k0[:, :, keys])
            np.testing.assert_array_equal(v1[:, :, keys], v0[:, :, keys])
    assert_close(outs[0][1], outs[1][1], REDUCE)
    assert_close(outs[0][2], outs[1][2], REDUCE)


def test_turns_through_the_engine_loop_reuse_checkpoints_and_give_numpy_tokens(models, tmp_path):
    """Two conversations, two turns each, through the engine loop with the cache on (checkpoints every 2
    blocks, restored into fresh slots): the CUDA replies are numpy's and the second turns reuse their prefix.
    Chunks of 6 keep every step (a chunk + the other slot's decode row) on the fp32 matvec."""
    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(tmp_path / "lfm2.gguf").fields)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    firsts = {"a": PROMPT[:17], "b": PROMPT[3:22]}

    async def run(model):
        runner = ModelRunner(model, 64, BLOCK, host_blocks=16)
        loop = EngineLoop(runner, tokenizer, num_slots=2, prefill_chunk=6, max_queue=8, integrity_checks=True,
                          state_checkpoint_every=2)
        loop.start()

        async def serve(rid, prompt):
            out = [d async for d in loop.submit(Request(rid, prompt, params))]
            return [t for d in out for t in d.token_ids], out[-1].usage.cached_tokens

        replies = dict(zip(firsts, await asyncio.gather(*(serve(k, p) for k, p in firsts.items()))))
        seconds = {k: firsts[k] + replies[k][0] + [40, 41] for k in firsts}
        seconds["c"] = PROMPT[:15] + [60, 61]  # branches off a 7 tokens past its checkpoint at 8: a state window
        again = dict(zip(seconds, await asyncio.gather(*(serve(k + "2", p) for k, p in seconds.items()))))
        await loop.shutdown(1)
        return replies, again

    got, want = asyncio.run(run(models[0])), asyncio.run(run(models[1]))
    assert got == want
    assert all(cached > 0 for _, cached in got[1].values())  # the second turns reused their checkpoints
    assert got[1]["c"][1] == 15 - 6  # c reused the K/V of 15 tokens, its 6-token window computed again


def test_lfm2_served_with_steps_launched_from_the_loop_gives_numpy_tokens(tmp_path, monkeypatch):
    """The server's path (api/serve.build_state): steps launched from the event loop in deferred-host mode on
    streams that really run later (tests/support/fake_cuda_async.py), so a captured checkpoint's DtoD copy, the
    kernel's in-place state update and the host reads of states are ordered only by the stream and its
    awaited event. The second turn reuses its checkpointed prefix; both turns give numpy's tokens."""
    from engine.backends.cuda.backend import CudaBackend
    from engine.loader import open_model
    from tests.support import fake_cuda_async
    from tests.support.server_harness import run_on_app

    path = tmp_path / "lfm2.gguf"
    write_tiny_lfm2(path, seed=4, n_ctx=256)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def turns(loaded):
        async def work(state, client):
            out, prompt = [], list(PROMPT)
            for turn in range(2):
                deltas = [d async for d in state.engine.submit(Request(f"t{turn}", prompt, params))]
                out.append(([t for d in deltas for t in d.token_ids], deltas[-1].usage.cached_tokens))
                prompt = prompt + out[-1][0] + [40, 41]
            return out

        return run_on_app(loaded, work, ctx_size=128, prefill_chunk=6, conversation_cache_mib=1)

    want = turns(open_model(str(path), backend=NumpyBackend()))
    driver = fake_cuda_async.install(monkeypatch, kernel_delay_s=0.0005)
    try:
        got = turns(open_model(str(path), backend=CudaBackend()))
    finally:
        driver.close()
    assert got == want and got[1][1] > 0
