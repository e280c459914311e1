"""Pipeline stages over a layer split: one asyncio task per stage, each with a worker of its own.

A group's step (its decodes plus at most one prefill chunk) enters stage 0's queue; each stage task takes
the next job and runs its layers through the stage backend's step runner (engine/backends/step_runner.py;
numpy: on a worker thread of its own, so two stages compute at once on two cores; CUDA: launched from the
loop onto the stage's stream, its completion event awaited without blocking), then hands the job (its
batch and hidden state: the hand-off buffer; CUDA keeps it on the device, ordered by events) to the
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
        self._runners = [s.backend.create_step_runner(w) for s, w in zip(self.stages, self._workers)]
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

    @property
    def num_in_flight(self) -> int:
        """Groups whose step is in the stages now (queued or computing)."""
        return len(self._jobs)

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
            started = time.perf_counter()
            try:
                result = await self._runners[index].run(lambda: self._launch(index, job),
                                                        lambda output: self._finish(index, job, output))
            except Exception as exc:  # noqa: BLE001 - a stage's failure belongs to its job, not the pipeline
                stats.failures += 1
                log.error("pipeline stage %d failed on group %d: %s", index, job.group, exc,
                          extra={"fields": {"stage": index, "group": job.group, "error": str(exc)}})
                if not job.future.done():
                    job.future.set_exception(StageFailure(index, exc))
                continue
            finally:
                stats.current_group = None
                self._count_busy(index, time.perf_counter() - started)
            if last:
                if not job.future.done():
                    job.future.set_result(result)
            else:
                self._enqueue(index + 1, job)

    def _launch(self, index: int, job: _Job):
        """This stage's layers for the job (the step runner decides on which thread; cuda: enqueued only).
        Returns the stage's pending output: the hand-off (x, h), or the last stage's logits."""
        stage = self.stages[index]
        if stage.is_first:
            job.batch = self.runner.prepare([(request.seq, n) for request, n in job.work])
        return self.runner.run_stage(stage, job.batch, job.hidden)

    def _finish(self, index: int, job: _Job, output):
        """Once the stage's output is complete, on its worker: keep the hand-off, or (last stage) count the
        computed tokens and sample."""
        job.hidden = output
        if index < len(self.stages) - 1:
            return None
        self.runner.commit([(request.seq, n) for request, n in job.work])
        return self.finish(job.work, output)

    def _count_busy(self, index: int, busy: float) -> None:
        self.stats[index].busy_seconds += busy
        self.stats[index].jobs += 1
        if self.metrics is not None:
            self.metrics.stage_busy_seconds.labels(str(index)).inc(busy)

    def _observe_depth(self, index: int) -> None:
        if self.metrics is not None:
            self.metrics.stage_queue_depth.labels(str(index)).set(self.stats[index].queue_depth)
