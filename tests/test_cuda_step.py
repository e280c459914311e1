"""A CUDA stage's step is launched from the event loop and its completion event awaited (engine/backends/
cuda/step.py), on a fake driver whose streams run later on threads of their own (tests/support/fake_cuda_async.py):
the loop answers /health while a long step is in flight, every kernel is launched from the loop thread, and
no thread blocks on a stream but the event waiter (cuEventSynchronize; none at all when polling). The worker
threads of the stages only sample."""
import asyncio
import threading
import time

import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.loader import open_model
from engine.model import load_model
from engine.sampling import SamplingParams
from scheduler.request import Request
from tests.support.device_params import GPU
from tests.support.reference_helpers import greedy_with_logits
from tests.support.server_harness import run_on_app
from tests.support.tiny_gguf import write_tiny_gguf

KERNEL_DELAY_S = 0.004  # every kernel this late: a step of the tiny model is tens of kernels
PROMPT = list(range(3, 11))  # 8 tokens: the fp32 matvec prefill, so numpy's greedy tokens are the reference


class _RecordingDriver:
    """The real driver, recording (like the fake) the blocking calls and the threads that launch kernels."""

    BLOCKING = ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")

    def __init__(self, real):
        self._real, self.blocking_calls, self.blocking_stacks, self.launch_threads = real, [], [], set()

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self.BLOCKING and name != "cuLaunchKernel":
            return attr

        def recorded(*args):
            thread = threading.current_thread().name
            if name == "cuLaunchKernel":
                self.launch_threads.add(thread)
            else:
                self.blocking_calls.append((name, thread))
            return attr(*args)

        return recorded

    def close(self):
        pass


@pytest.fixture(params=["fake", GPU])
def slow_gpu(request, monkeypatch, tmp_path):
    """(driver with blocking_calls / launch_threads, tiny model path): the fake with slow kernels and streams
    on threads, or the real GPU (marked cuda) behind a recording proxy."""
    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q8_0")
    if request.param == "fake":
        from tests.support import fake_cuda_async

        driver = fake_cuda_async.install(monkeypatch, kernel_delay_s=KERNEL_DELAY_S)
    else:
        from engine.backends.cuda import device as cuda_device
        from tests.support.fake_cuda import patch_driver

        available, reason = cuda_device.probe()
        if not available:
            pytest.skip(f"no CUDA device: {reason}")
        driver = _RecordingDriver(cuda_device.driver)
        patch_driver(monkeypatch, driver)
    yield driver, tmp_path / "m.gguf"
    driver.close()


@pytest.mark.parametrize("wait_mode", ["thread", "poll"])
def test_the_loop_serves_health_while_a_long_cuda_step_is_in_flight(slow_gpu, monkeypatch, wait_mode):
    from engine.backends.cuda.backend import CudaBackend

    driver, path = slow_gpu
    monkeypatch.setenv("STRATA_CUDA_WAIT", wait_mode)
    backend = CudaBackend()  # graphs on: decode steps are replays, enqueued and awaited the same way
    loaded = open_model(str(path), backend=backend)
    assert loaded.model.backend.waiter.mode == wait_mode
    loop_thread = []

    async def work(state, client):
        loop_thread.append(threading.current_thread().name)
        assert driver.blocking_calls, "the check sees blocking calls (the load synchronises, before serving)"
        driver.blocking_calls.clear()
        driver.launch_threads.clear()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        tokens, health_s, in_flight = [], [], []

        async def consume():
            async for delta in state.engine.submit(Request("r", list(PROMPT), params)):
                tokens.extend(delta.token_ids)

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.sleep(0.01)
            started = time.perf_counter()
            response = await client.get("/health")
            assert response.status_code == 200
            health_s.append(time.perf_counter() - started)
            in_flight.append(state.engine.pipeline.where(0) is not None)
        await task
        return tokens, health_s, in_flight

    started = time.perf_counter()
    tokens, health_s, in_flight = run_on_app(loaded, work)
    elapsed = time.perf_counter() - started
    if isinstance(driver, _RecordingDriver):  # a GPU: steps take microseconds, so only the threads are checked
        assert tokens
    else:
        assert sum(in_flight) >= 3, "/health was answered while steps were in flight"
        assert max(health_s) < 0.25 < elapsed, (max(health_s), elapsed)
    # Launched from the loop; the only thread that ever waits for the device is the event waiter's.
    assert driver.launch_threads == {loop_thread[0]}
    waits = {(call, thread) for call, thread in driver.blocking_calls}
    assert waits <= {("cuEventSynchronize", "cuda-event-waiter")}, (waits, driver.blocking_stacks[:1])
    if not isinstance(driver, _RecordingDriver):  # slow steps: the waiter really waits, polling never does
        assert (wait_mode == "thread") == bool(waits)
    expected, _ = greedy_with_logits(load_model(path, NumpyBackend())[0], PROMPT, 4, chunk=16, kv_type="f16")
    assert tokens == expected
    assert backend.graphs.replays >= 2  # the decode steps were graph replays, enqueued and awaited too
    backend.close()


def test_a_two_stage_cuda_pipeline_hands_off_through_awaited_events(slow_gpu):
    """Stage 0's (x, h) stay on the device: stage 1's stream waits on stage 0's event and copies them (DtoD),
    stage 0's stream waits on that copy before reusing them; two groups keep both stages busy. Same tokens
    as numpy, no host wait."""
    from engine.backends.cuda.backend import CudaBackend

    driver, path = slow_gpu
    backend = CudaBackend()
    loaded = open_model(str(path), backend=backend)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [list(PROMPT), [5, 9, 2, 7, 11, 4]]

    async def work(state, client):
        driver.blocking_calls.clear()
        if hasattr(driver, "copy_log"):
            driver.copy_log.clear()

        async def consume(i, prompt):
            return [t async for d in state.engine.submit(Request(f"r{i}", prompt, params)) for t in d.token_ids]

        return await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))

    got = run_on_app(loaded, work, layer_split="1", batch=2, batch_groups="2")
    reference = load_model(path, NumpyBackend())[0]
    assert got == [greedy_with_logits(reference, p, 4, chunk=16, kv_type="f16")[0] for p in prompts]
    assert {call for call, _ in driver.blocking_calls} <= {"cuEventSynchronize"}
    if hasattr(driver, "copy_log"):  # 2 requests x 4 steps: (x, h) handed off DtoD, only the logits DtoH
        assert (driver.copy_log.count("DtoD"), driver.copy_log.count("DtoH")) == (2 * 4 * 2, 2 * 4)
    backend.close()


def test_a_failing_launch_fails_only_its_step_and_leaves_deferred_mode(slow_gpu):
    """A launch that raises leaves the backend out of deferred mode; the next step runs and is awaited."""
    from engine.backends.cuda.backend import CudaBackend
    from engine.backends.cuda.step import StreamStepRunner
    from concurrent.futures import ThreadPoolExecutor

    backend = CudaBackend(graphs=False)
    worker = ThreadPoolExecutor(1)
    runner = StreamStepRunner(backend, worker)
    x = backend.upload_activation(np.arange(6, dtype=np.float32))

    def bad_launch():
        raise RuntimeError("launch failed")

    async def main():
        with pytest.raises(RuntimeError, match="launch failed"):
            await runner.run(bad_launch, lambda out: out)
        return await runner.run(lambda: backend.to_host(x), lambda out: out * 2)

    np.testing.assert_array_equal(asyncio.run(main()), np.arange(6, dtype=np.float32) * 2)
    assert not backend.defers_host and backend.is_idle
    worker.shutdown()
    backend.close()


def test_parks_and_restores_are_ordered_by_events_and_keep_every_token(slow_gpu):
    """Four conversations rotating through a device pool that holds about two: their blocks park to the pinned
    host tier and come back. Moves queue on the mover's copy stream and the stage's stream waits on their
    event; nothing blocks (but the event waiter), and the replies equal the cache-off run's."""
    from engine.backends.cuda.backend import CudaBackend
    from engine.sequence import ModelRunner
    from scheduler.engine_loop import EngineLoop

    driver, path = slow_gpu
    if hasattr(driver, "kernel_delays"):  # the moves slow, the steps fast: a step not ordered after them fails
        driver.kernel_delay_s = 0.0
        driver.kernel_delays = {k: 0.02 for k in ("scatter_kv_blocks_f32", "gather_kv_blocks_f32", "copy_kv_blocks_f32")}
    backend = CudaBackend()
    loaded = open_model(str(path), backend=backend)

    def play(cache_on):
        async def main():
            runner = ModelRunner(loaded.model, 12, 4, host_blocks=64 if cache_on else 0, kv_type="f16")
            loop = EngineLoop(runner, loaded.tokenizer, num_slots=1, prefill_chunk=16, max_queue=8,
                              prefix_cache=cache_on, integrity_checks=True)
            loop.start()
            driver.blocking_calls.clear()
            history, replies = {}, []
            for turn in range(3):
                for conv in range(4):
                    prompt = history.get(conv, list(range(10 + conv, 20 + conv))) + [40 + conv, 41 + turn]
                    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
                    tokens = [t async for d in loop.submit(Request(f"c{conv}t{turn}", prompt, params))
                              for t in d.token_ids]
                    history[conv] = prompt + tokens
                    replies.append(tokens)
            blocking = list(driver.blocking_calls)
            await loop.shutdown(1)
            return replies, loop.cache.stats, blocking

        return asyncio.run(main())

    on, stats, blocking = play(True)
    off, _, _ = play(False)
    assert on == off
    assert stats["parks"] > 0 and stats["restores"] > 0
    assert {call for call, _ in blocking} <= {"cuEventSynchronize"}, blocking
    backend.close()
