"""Awaiting a CUDA event from the asyncio loop without blocking it. Two ways, chosen per backend:

- "thread": one waiter thread per stream blocks in cuEventSynchronize and resolves the awaiting future with
  `loop.call_soon_threadsafe`. Costs a thread wake-up and a loop wake-up per step; the loop sleeps meanwhile.
- "poll": the coroutine asks cuEventQuery and sleeps between asks, 50 us doubling up to 1 ms. Costs no
  thread but up to one backoff interval of extra latency, and a few loop iterations per step.

scripts/bench_cuda.py measures both (completion latency after a step of known length). The event functions
are injected, so the logic is tested on machines without a GPU with fake events.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable

WAIT_MODES = ("thread", "poll")
POLL_START_S = 50e-6
POLL_CAP_S = 1e-3


class EventWaiter:
    """`await waiter.wait(event)` returns once `event` has completed.

    query(event) -> bool says whether it completed (cuEventQuery); synchronize(event) blocks until it has
    (cuEventSynchronize); bind() runs once in the waiter thread (it makes the device context current there).
    Events of one waiter are waited for in the order given, which is their completion order on one stream.
    """

    def __init__(self, mode: str, query: Callable[[object], bool], synchronize: Callable[[object], None],
                 bind: Callable[[], None] = lambda: None):
        if mode not in WAIT_MODES:
            raise ValueError(f"wait mode {mode!r} is not one of {', '.join(WAIT_MODES)}")
        self.mode = mode
        self._query, self._synchronize, self._bind = query, synchronize, bind
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    async def wait(self, event) -> None:
        if self.mode == "poll":
            await self._poll(event)
        else:
            await self._via_thread(event)

    async def _poll(self, event) -> None:
        delay = POLL_START_S
        while not self._query(event):
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_CAP_S)

    async def _via_thread(self, event) -> None:
        if self._query(event):  # already done: no thread round trip
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._start_thread()
        self._jobs.put((event, loop, future))
        await future

    def _start_thread(self) -> None:
        if self._thread is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="cuda-event-waiter", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._bind()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            event, loop, future = job
            try:
                self._synchronize(event)
                outcome = None
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine, which re-raises it
                outcome = exc
            loop.call_soon_threadsafe(_resolve, future, outcome)

    def close(self) -> None:
        """Stop the waiter thread after the jobs already queued (idempotent)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None


def _resolve(future: asyncio.Future, outcome: Exception | None) -> None:
    if future.done():  # the awaiting task was cancelled meanwhile
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)
