"""Pipeline stages over a layer split: one asyncio task per stage, each with a worker of its own.

A group's step (its decodes plus at most one prefill chunk) enters stage 0's queue; each stage task takes
the next job, runs its layers on its worker (numpy: a thread of its own, so two stages compute at once on
two cores; CUDA: a stream), then hands the job (its batch and hidden state: the hand-off buffer) to the
next stage's queue and goes on with the next job at once. So while stage 1 works on group g, stage 0
already works on group g + 1. The last stage applies the head and samples; the job's future resolves.

A stage that raises fails only the job it was running (its future gets a StageFailure); the stage task
goes on with the next job. `close()` drains the stages in order: each finishes what it holds, passes the
close marker on and stops.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from engine.batch import BatchMeta
from engine.sequence import ModelRunner
from engine.stages import Stage

log = logging.getLogger("strata.pipeline")
_CLOSE = object()  # the marker close() sends down the stages


class StageFailure(RuntimeError):
    """A stage raised while computing a group's step; only that group's requests fail."""

    def __init__(self, stage: int, cause: BaseException):
        super().__init__(f"pipeline stage {stage} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause


@dataclass
class StageStats:
    """What an operator needs to see a bubble: how busy each stage is and what waits in front of it."""

    busy_seconds: float = 0.0
    jobs: int = 0
    failures: int = 0
    queue_depth: int = 0
    current_group: int | None = None


@dataclass
class _Job:
    group: int
    work: list  # [(request, new tokens)]
    future: asyncio.Future
    batch: BatchMeta | None = None
    hidden: Any = None  # the hand-off buffer: what stage i gives stage i + 1
    stage: int = 0  # where the job is now


class Pipeline:
    """Runs group steps through the runner's stages. `finish(work, logits)` turns the last stage's logits
    into the step's results (sampling); it runs on the last stage's worker."""

    def __init__(self, runner: ModelRunner, finish: Callable[[list, Any], list], metrics=None):
        self.runner = runner
        self.stages: list[Stage] = runner.stages
        self.finish = finish
        self.metrics = metrics
        self.stats = [StageStats() for _ in self.stages]
        self._queues: list[asyncio.Queue] = []
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"strata-stage{s.index}") for s in self.stages]
        self._tasks: list[asyncio.Task] = []
        self._jobs: dict[int, _Job] = {}  # group -> its job in flight
        self.started_s = time.perf_counter()

    def start(self) -> None:
        """Create the stage tasks on the running event loop."""
        loop = asyncio.get_running_loop()
        self._queues = [asyncio.Queue() for _ in self.stages]
        self._tasks = [loop.create_task(self._stage_loop(i), name=f"strata-stage-{i}") for i in range(len(self.stages))]
        self.started_s = time.perf_counter()

    async def run(self, group: int, work: list) -> list:
        """Compute one step of `group` through every stage; returns the finish() results.

        Raises StageFailure when a stage raised for this job."""
        job = _Job(group, work, asyncio.get_running_loop().create_future())
        self._jobs[group] = job
        self._enqueue(0, job)
        try:
            return await job.future
        finally:
            self._jobs.pop(group, None)

    def where(self, group: int) -> int | None:
        """The stage a group's step is in now (queued or computing), None when it is not in flight."""
        job = self._jobs.get(group)
        return job.stage if job is not None else None

    async def close(self) -> None:
        """Drain the stages in order and stop their workers."""
        if self._tasks:
            self._queues[0].put_nowait(_CLOSE)
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks = []
        for worker in self._workers:
            worker.shutdown(wait=True)

    def snapshot(self) -> list[dict]:
        """Per-stage state for /pipeline and /slots."""
        elapsed = max(time.perf_counter() - self.started_s, 1e-9)
        return [
            {"stage": s.index, "layers": [s.layers.start, s.layers.stop - 1], "busy_seconds": round(st.busy_seconds, 3),
             "utilization": round(st.busy_seconds / elapsed, 3), "jobs": st.jobs, "failures": st.failures,
             "queue_depth": st.queue_depth, "current_group": st.current_group}
            for s, st in zip(self.stages, self.stats)
        ]

    # -- stage tasks ----------------------------------------------------------------------------------
    def _enqueue(self, index: int, job) -> None:
        if job is not _CLOSE:
            job.stage = index
            self.stats[index].queue_depth += 1
            self._observe_depth(index)
        self._queues[index].put_nowait(job)

    async def _stage_loop(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        queue, stats, last = self._queues[index], self.stats[index], index == len(self.stages) - 1
        while True:
            job = await queue.get()
            if job is _CLOSE:
                if not last:
                    self._queues[index + 1].put_nowait(_CLOSE)
                return
            stats.queue_depth -= 1
            self._observe_depth(index)
            stats.current_group = job.group
            try:
                result = await loop.run_in_executor(self._workers[index], self._compute, index, job)
            except Exception as exc:  # noqa: BLE001 - a stage's failure belongs to its job, not the pipeline
                stats.failures += 1
                log.error("pipeline stage %d failed on group %d: %s", index, job.group, exc,
                          extra={"fields": {"stage": index, "group": job.group, "error": str(exc)}})
                if not job.future.done():
                    job.future.set_exception(StageFailure(index, exc))
                continue
            finally:
                stats.current_group = None
            if last:
                if not job.future.done():
                    job.future.set_result(result)
            else:
                self._enqueue(index + 1, job)

    def _compute(self, index: int, job: _Job):
        """On the stage's worker: this stage's layers for the job (and, on the last stage, the head and
        sampling)."""
        started = time.perf_counter()
        try:
            stage = self.stages[index]
            seq_work = [(request.seq, n) for request, n in job.work]
            if stage.is_first:
                job.batch = self.runner.prepare(seq_work)
            job.hidden = self.runner.run_stage(stage, job.batch, job.hidden)
            if index < len(self.stages) - 1:
                return None
            self.runner.commit(seq_work)
            return self.finish(job.work, job.hidden)
        finally:
            busy = time.perf_counter() - started
            self.stats[index].busy_seconds += busy
            self.stats[index].jobs += 1
            if self.metrics is not None:
                self.metrics.stage_busy_seconds.labels(str(index)).inc(busy)

    def _observe_depth(self, index: int) -> None:
        if self.metrics is not None:
            self.metrics.stage_queue_depth.labels(str(index)).set(self.stats[index].queue_depth)
