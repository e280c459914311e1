"""Awaiting device events from asyncio, both ways (waiter thread, polling), with fake events."""
import asyncio
import threading
import time

import pytest

from engine.backends.cuda.wait import EventWaiter


class FakeEvent:
    """Completes `delay_s` after creation (like a kernel already queued on a stream)."""

    def __init__(self, delay_s: float, error: Exception | None = None):
        self.done = threading.Event()
        self.error = error
        threading.Timer(delay_s, self.done.set).start()


def _waiter(mode: str, calls: list) -> EventWaiter:
    def query(event):
        calls.append("query")
        return event.done.is_set()

    def synchronize(event):
        calls.append("sync")
        event.done.wait()
        if event.error:
            raise event.error

    return EventWaiter(mode, query, synchronize)


@pytest.mark.parametrize("mode", ["thread", "poll"])
def test_wait_returns_after_the_event_and_leaves_the_loop_free(mode):
    calls, ticks = [], []
    waiter = _waiter(mode, calls)

    async def ticker():
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.002)

    async def main():
        task = asyncio.create_task(ticker())
        started = time.perf_counter()
        event = FakeEvent(0.05)
        await waiter.wait(event)
        task.cancel()
        return time.perf_counter() - started, event

    elapsed, event = asyncio.run(main())
    waiter.close()
    assert event.done.is_set() and 0.04 < elapsed < 1.0
    assert len(ticks) > 5  # the loop kept running other tasks while waiting


def test_polling_backs_off_to_the_cap():
    calls = []
    waiter = _waiter("poll", calls)
    asyncio.run(waiter.wait(FakeEvent(0.1)))
    # 50 us doubling to 1 ms: about 100 ms / 1 ms + 5 asks, far fewer than a busy loop would make
    assert 10 < calls.count("query") < 200


def test_thread_mode_skips_the_thread_for_a_completed_event():
    calls = []
    waiter = _waiter("thread", calls)
    event = FakeEvent(0)
    event.done.wait()
    asyncio.run(waiter.wait(event))
    assert calls == ["query"] and waiter._thread is None


def test_thread_mode_hands_a_driver_error_to_the_awaiting_task():
    waiter = _waiter("thread", [])
    with pytest.raises(RuntimeError, match="launch failed"):
        asyncio.run(waiter.wait(FakeEvent(0.01, RuntimeError("launch failed"))))
    waiter.close()


def test_thread_mode_survives_a_cancelled_waiter():
    waiter = _waiter("thread", [])

    async def main():
        task = asyncio.create_task(waiter.wait(FakeEvent(0.05)))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.08)  # the thread resolves a future that is already cancelled: no error
        await waiter.wait(FakeEvent(0.01))

    asyncio.run(main())
    waiter.close()


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="wait mode 'spin'"):
        EventWaiter("spin", bool, bool)
