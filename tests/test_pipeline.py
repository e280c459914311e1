"""Pipeline stages over a layer split: a split model computes exactly what the whole model computes, block
operations act on every stage, and batch groups (row maps) change no token and keep every slot's cache."""
import asyncio

import numpy as np
import pytest

from engine.sampling import Sampler, SamplingParams
from engine.sequence import ModelRunner, Sequence
from engine.stages import split_layers
from scheduler.pipeline import Pipeline, StageFailure
from scheduler.request import Request
from scheduler.step import sample_step
from tests.support.pipeline_runs import random_prompt, run_conversations
from tests.support.reference_helpers import chunked_step_logits

SPLITS = [(), (2,), (1, 3)]  # one, two and three stages of a 4-layer model


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("llama", seed=5, n_ctx=512, n_layer=4)


def test_split_layers_cuts_at_the_given_first_layers_and_names_bad_values():
    assert split_layers(48, ()) == [range(0, 48)]
    assert split_layers(48, (16, 32)) == [range(0, 16), range(16, 32), range(32, 48)]
    for bad in [(0,), (48,), (16, 16), (32, 16)]:
        with pytest.raises(ValueError, match="--layer-split"):
            split_layers(48, bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_split_model_computes_bit_identical_logits(load_tiny, arch):
    model, _ = load_tiny(arch, seed=2, **({} if arch == "gemma3" else {"n_layer": 4}))
    n = model.config.n_layers
    prompts = [random_prompt(13, 1), random_prompt(7, 2)]

    def run(split):  # chunked prefill, then decode-sized steps
        return chunked_step_logits(ModelRunner(model, 32, 4, layer_split=split), prompts)

    whole = run(())
    for split in [(1,), (2, n - 1)]:
        assert all(np.array_equal(a, b) for a, b in zip(whole, run(split)))


def test_block_operations_act_on_every_stage(tiny):
    model, _ = tiny
    whole, split = ModelRunner(model, 16, 4, host_blocks=4), ModelRunner(model, 16, 4, host_blocks=4, layer_split=(1, 3))
    for runner in (whole, split):
        seq = Sequence(random_prompt(8, 3))
        runner.ensure_blocks(seq, 8)
        runner.step([(seq, 8)])
    k, v = whole.read_block("device", 1)
    sk, sv = split.read_block("device", 1)
    assert k.shape == (4, 2, 4, 16) and np.array_equal(k, sk) and np.array_equal(v, sv)
    split.move_blocks([(1, 2)], [], [])  # park block 1 to host slot 2
    assert np.array_equal(split.read_block("host", 2)[0], k)
    split.move_blocks([], [(2, 9)], [(1, 10)])  # restore it to block 9, copy block 1 to block 10
    for block in (9, 10):
        assert all(np.array_equal(a, b) for a, b in zip(split.read_block("device", block), (k, v)))
    split.write_block(12, k * 2, v * 3)
    assert np.array_equal(split.stages[2].kv_pool.k[:, :, 48:52], (k * 2)[3:])  # the last stage's layer


@pytest.fixture(scope="module")
def unpipelined(tiny):
    prompts = [random_prompt(n, seed=n) for n in (3, 21, 30, 9)]
    tokens, _, _, _ = run_conversations(tiny, (), 1, prompts)
    return prompts, tokens


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("split", SPLITS)
def test_pipelined_greedy_outputs_equal_the_unpipelined_loop(tiny, unpipelined, split, groups):
    prompts, expected = unpipelined
    tokens, reasons, peak, loop = run_conversations(tiny, split, groups, prompts)
    assert tokens == expected and reasons == ["length"] * 4
    assert peak == groups  # the groups really were in the pipeline at once
    stats = loop.pipeline.snapshot()
    assert len(stats) == len(split) + 1 and len({s["jobs"] for s in stats}) == 1  # every step crossed every stage


def test_a_stage_that_fails_on_one_group_fails_only_that_group(tiny, unpipelined):
    prompts, expected = unpipelined
    state = {"failed": False}

    def inject(pipeline: Pipeline):
        real = pipeline._launch

        def launch(index, job):
            if index == 1 and not state["failed"] and any(r.request_id == "c1" for r, _ in job.work):
                state["failed"] = True
                raise RuntimeError("injected stage fault")
            return real(index, job)

        pipeline._launch = launch

    tokens, reasons, _, loop = run_conversations(tiny, (2,), 4, prompts, wrap_pipeline=inject)
    assert state["failed"] and reasons == ["length", "error", "length", "length"]
    assert [tokens[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert loop.pipeline.snapshot()[1]["failures"] == 1 and loop.cache.num_free == 256


def test_close_drains_the_stages_in_order(tiny):
    model, _ = tiny
    runner = ModelRunner(model, 64, 4, layer_split=(1, 3))
    order = []

    def finish(work, logits):
        order.append([request.request_id for request, _ in work])
        return sample_step(work, logits)

    async def main():
        pipeline = Pipeline(runner, finish)
        pipeline.start()
        jobs = []
        for g, n in enumerate((5, 9)):
            request = Request(f"r{g}", random_prompt(n, g), SamplingParams(temperature=0, max_tokens=1))
            request.seq = Sequence(list(request.prompt_ids))
            runner.ensure_blocks(request.seq, n)
            request.sampler = Sampler(request.params)
            jobs.append(asyncio.ensure_future(pipeline.run(g, [(request, n)])))
        await asyncio.sleep(0)
        await pipeline.close()  # both jobs were queued: close lets them through every stage first
        return [j.result()[0].token for j in jobs], pipeline

    tokens, pipeline = asyncio.run(main())
    assert all(isinstance(t, int) for t in tokens) and order == [["r0"], ["r1"]]  # each job whole, in order
    assert [s["jobs"] for s in pipeline.snapshot()] == [2, 2, 2]


def test_stage_failure_names_the_stage():
    failure = StageFailure(2, ValueError("bad shape"))
    assert "stage 2" in str(failure) and "bad shape" in str(failure) and failure.stage == 2


def test_host_tier_grows_in_segments_keeping_every_parked_block(tiny):
    model, _ = tiny
    runner = ModelRunner(model, 16, 4, host_blocks=0, layer_split=(1, 3))
    seq = Sequence(random_prompt(8, 3))
    runner.ensure_blocks(seq, 8)
    runner.step([(seq, 8)])
    runner.grow_host(1)
    runner.move_blocks([(0, 0)], [], [])
    runner.grow_host(3)  # a second segment: slot 0 keeps its bytes
    runner.move_blocks([(1, 2)], [], [])
    runner.check_stages()
    for slot, block in ((0, 0), (2, 1)):
        assert all(np.array_equal(a, b) for a, b in zip(runner.read_block("host", slot), runner.read_block("device", block)))
