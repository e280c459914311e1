"""How a pipeline stage's step runs without blocking the event loop: one interface, one runner per backend.

    await runner.run(launch, finish)
        launch():          the stage's device work for one job; returns its pending output
        finish(output):    host work once that output is complete (hand-off copy, sampling); its result

numpy (`ThreadStepRunner`): both on the stage's worker thread, so two stages really compute at once on two
cores; the loop awaits the worker's future. cuda (engine/backends/cuda/step.py): launch on the loop thread
(launches and a decode graph replay only enqueue), then the completion event is awaited through the
backend's EventWaiter, and finish runs on the worker (sampling is milliseconds of numpy). Each backend
makes its own with `create_step_runner(worker)` (engine/backends/base.py).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, Callable, Protocol


class StepRunner(Protocol):
    async def run(self, launch: Callable[[], Any], finish: Callable[[Any], Any]) -> Any:
        """finish(launch()), with the loop free while the device works; exceptions of either propagate."""


class ThreadStepRunner:
    """launch and finish on the stage's worker thread (numpy: the computation itself blocks that thread)."""

    def __init__(self, worker: Executor):
        self.worker = worker

    async def run(self, launch: Callable[[], Any], finish: Callable[[Any], Any]) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, lambda: finish(launch()))

