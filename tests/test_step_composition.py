"""What each engine step carries (scheduler/step_plan.py): every decode every step, prompt chunks within the
step's budget, prompts that arrive together read together, long ones one after another, shortest first."""
import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from engine.generate import generate
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler import step as step_module
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from scheduler.step_plan import compose_step


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("llama", seed=3, n_ctx=512)


@pytest.fixture
def steps(monkeypatch):
    """Every step's work as [(request id, new tokens, whether they are prompt tokens)], in step order."""
    seen = []
    real = step_module.sample_step

    def spy(work, logits):  # runs after the step's forward: num_computed already counts its tokens
        seen.append([(r.request_id, n, r.seq.num_computed - n < r.prompt_len) for r, n in work])
        return real(work, logits)

    monkeypatch.setattr("scheduler.engine_loop.sample_step", spy)
    return seen


def _loop(tiny, chunk=8, budget=32):
    model, tokenizer = tiny
    return EngineLoop(ModelRunner(model, 256, 4), tokenizer, num_slots=4, prefill_chunk=chunk,
                      prefill_step_tokens=budget, max_queue=8, integrity_checks=True)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def _greedy(max_tokens=4):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def _collect(stream):
    return [t async for delta in stream for t in delta.token_ids]


def _prompt_tokens(work, request_id):
    return sum(n for rid, n, prompt in work if rid == request_id and prompt)


def test_a_decode_keeps_its_pace_while_a_long_prompt_is_read(tiny, steps):
    async def main():
        loop = _loop(tiny)
        loop.start()
        short = loop.submit(Request("short", _prompt(4, 1), _greedy(100)))
        await short.__anext__()  # short is decoding now
        long = loop.submit(Request("long", _prompt(60, 2), _greedy(2)))
        await asyncio.gather(_collect(short), _collect(long))
        await loop.shutdown(1)

    asyncio.run(main())
    long_steps = [w for w in steps if _prompt_tokens(w, "long")]
    assert [_prompt_tokens(w, "long") for w in long_steps] == [8] * 7 + [4]  # 60 tokens in chunks of 8
    assert all(("short", 1, False) in w for w in long_steps)  # every one of them carried short's next token


def test_prompts_that_arrive_together_are_read_in_one_step(tiny, steps):
    model, tokenizer = tiny
    prompts = {"a": _prompt(5, 3), "b": _prompt(7, 4), "c": _prompt(6, 5)}
    alone = {k: generate(ModelRunner(model, 64, 4), tokenizer, p, _greedy()).token_ids for k, p in prompts.items()}

    async def main():
        loop = _loop(tiny, chunk=8, budget=32)
        loop.start()
        streams = {k: loop.submit(Request(k, p, _greedy())) for k, p in prompts.items()}  # before the loop runs
        tokens = dict(zip(streams, await asyncio.gather(*[_collect(s) for s in streams.values()])))
        await loop.shutdown(1)
        return tokens

    tokens = asyncio.run(main())
    assert sorted(steps[0]) == [("a", 5, True), ("b", 7, True), ("c", 6, True)]
    assert len(steps) == 4  # that step sampled every first token; three steps decode the other three
    assert tokens == alone


def test_long_prompts_are_read_one_after_another_shortest_first(tiny, steps):
    async def main():
        loop = _loop(tiny, chunk=8, budget=32)
        loop.start()
        await asyncio.gather(_collect(loop.submit(Request("a", _prompt(20, 6), _greedy(2)))),
                             _collect(loop.submit(Request("b", _prompt(13, 7), _greedy(2)))))
        await loop.shutdown(1)

    asyncio.run(main())
    prompt_steps = [[(rid, n) for rid, n, prompt in w if prompt] for w in steps if any(p for *_, p in w)]
    # b (13) goes first; a joins in the step where b ends and goes on alone
    assert prompt_steps == [[("b", 8)], [("b", 5), ("a", 8)], [("a", 8)], [("a", 4)]]


def test_a_short_prompt_is_read_beside_a_long_one_without_waiting_for_it(tiny, steps):
    async def main():
        loop = _loop(tiny, chunk=8, budget=32)
        loop.start()
        long = asyncio.ensure_future(_collect(loop.submit(Request("long", _prompt(200, 8), _greedy(2)))))
        while loop.num_steps < 2:
            await asyncio.sleep(0.001)
        await _collect(loop.submit(Request("short", _prompt(5, 9), _greedy(2))))
        await long
        await loop.shutdown(1)

    asyncio.run(main())
    step = next(w for w in steps if _prompt_tokens(w, "short"))
    assert _prompt_tokens(step, "short") == 5 and _prompt_tokens(step, "long") == 8


def _fake(pending, admitted_s, prompt=True):
    return SimpleNamespace(request_id=f"{pending}@{admitted_s}", admitted_s=admitted_s, is_prefilling=prompt,
                           seq=SimpleNamespace(num_pending=pending))


def _plan(running, chunk, budget):
    return [(r.request_id, n) for r, n in compose_step(running, chunk, budget)]


def test_decodes_come_first_and_are_never_left_out_for_a_prompt():
    running = [_fake(100, 0.0), _fake(1, 1.0, prompt=False), _fake(1, 2.0, prompt=False)]
    assert _plan(running, chunk=512, budget=1) == [("1@1.0", 1), ("1@2.0", 1), ("100@0.0", 100)]


def test_prompts_fill_the_budget_until_one_goes_on():
    running = [_fake(300, 0.0), _fake(120, 1.0), _fake(2000, 2.0), _fake(50, 3.0)]
    assert _plan(running, chunk=512, budget=512) == [("50@3.0", 50), ("120@1.0", 120), ("300@0.0", 300),
                                                     ("2000@2.0", 42)]
    assert _plan(running, chunk=100, budget=512) == [("50@3.0", 50), ("120@1.0", 100)]


def test_a_budget_below_the_chunk_reads_one_prompt_per_step():
    running = [_fake(30, 0.0), _fake(40, 1.0)]
    assert _plan(running, chunk=64, budget=16) == [("30@0.0", 30)]
    assert _plan([_fake(30, 0.0), _fake(30, 1.0)], chunk=64, budget=64) == [("30@0.0", 30), ("30@1.0", 30)]
