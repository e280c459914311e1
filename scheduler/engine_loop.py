"""The engine loop: continuous batching over slots, on the server's one event loop.

The running requests are divided into --batch-groups groups (a group is a list of slot rows, never a
padded range, so every slot keeps its cache whatever the grouping). Each group's step packs all its decoding
requests' next tokens and prompt chunks within a token budget into one batched forward (scheduler/step_plan.py):
a long prompt delays the others' decode by at most one chunk a step, and prompts that arrive together are read
in the same steps as far as the budget allows. Steps run through the pipeline stages of a layer split
(scheduler/pipeline.py), each stage on a worker of its own, while the event loop keeps serving HTTP; with
several groups the stages work on different groups at once. Everything else (admission, detokenisation,
stop strings, grammar state, finishing) happens on the loop between a group's steps; a constrained request's
next-token mask is begun when its step is scheduled, so it is computed beside the forward pass. Memory
goes through the admission (memory/service.py): the requests' plans (memory/requests.py) inline between
steps, operators' and other holders' queued.

    submit(request) -> async iterator of Delta      abort(request_id)      shutdown(timeout_s)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

from engine.sequence import ModelRunner
from engine.tokenizer import Tokenizer
from scheduler import engine_views
from scheduler.cache.persistence import flush_to_disk
from scheduler.cache.setup import create_cache
from scheduler.cache.conversation_activity import ACTIVE_WINDOW_S
from scheduler.conversations import ConversationLog
from scheduler.cache.disk_tier import DiskTier
from scheduler.cache.hybrid_steps import HybridSteps
from scheduler.cache.device_pool import resize_pool
from scheduler.cache.write_behind import TICK_S as WRITE_BEHIND_TICK_S, WriteBehind
from scheduler.memory.admission import MemoryAdmission
from scheduler.memory.service import MemoryService
from scheduler.metrics import Metrics
from scheduler.output import PROGRESS_INTERVAL_S, OutputProcessor
from scheduler.pipeline import Pipeline
from scheduler.request import Delta, Request
from scheduler.memory.requests import RequestMemory
from scheduler.slot_table import SlotTable
from scheduler.step import StepResult, sample_step

log = logging.getLogger("strata.scheduler")


class QueueFullError(RuntimeError):
    """The wait queue is at --max-queue; the API answers 503 with Retry-After."""


class ShuttingDownError(RuntimeError):
    """The server is stopping and admits nothing new."""


def _log_crash(task: asyncio.Task) -> None:
    """A loop that died would leave every stream waiting: say so loudly (a bug, never a user error)."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("the engine loop stopped: %r", task.exception(), exc_info=task.exception())


class EngineLoop:
    """Owns the slots, the wait queue, the batch groups and the pipeline of one model."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, num_slots: int, prefill_chunk: int,
                 max_queue: int, prefill_step_tokens: int | None = None, metrics: Metrics | None = None,
                 progress_interval_s: float = PROGRESS_INTERVAL_S,
                 prefix_cache: bool = True, integrity_checks: bool = False, disk: DiskTier | None = None,
                 batch_groups: int = 1, admission: MemoryAdmission | None = None,
                 conversation_active_s: float = ACTIVE_WINDOW_S, write_behind_mib_s: float = 0,
                 device_min_blocks: int | None = None, state_checkpoint_every: int | None = None,
                 hidden_token_ids: frozenset[int] = frozenset()):
        self.runner = runner
        self.disk = disk
        self.cache = create_cache(runner, disk, admission, enabled=prefix_cache, device_min_blocks=device_min_blocks,
                                  active_window_s=conversation_active_s, checkpoint_every=state_checkpoint_every)
        self.hybrid = HybridSteps(runner, self.cache)  # recurrent states of a hybrid model; no-ops otherwise
        # Blocks reach the disk while serving, so a kill -9 loses seconds of work, not the whole cache.
        self.write_behind = WriteBehind(self.cache, runner.layout.bytes_per_block, write_behind_mib_s) \
            if disk is not None and prefix_cache and write_behind_mib_s > 0 else None
        self.wake = asyncio.Event()
        self.memory = MemoryService(self.cache, on_change=self.wake.set)
        self.integrity_checks = integrity_checks  # tests: check the cache after every admission and step
        self.num_slots = num_slots
        self.prefill_chunk = prefill_chunk  # most tokens of one prompt in one step
        # most prompt tokens of all prompts in one step (None: one chunk's worth, a prompt per step)
        self.prefill_step_tokens = prefill_step_tokens or prefill_chunk
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.output = OutputProcessor(tokenizer, progress_interval_s, hidden_token_ids)
        self.conversations = ConversationLog()  # named by the clients, for /cache
        self.num_groups = max(1, min(batch_groups, num_slots))
        self.table = SlotTable(num_slots, self.num_groups)
        self.pipeline = Pipeline(runner, sample_step, self.metrics)
        self.in_flight: dict[int, asyncio.Task] = {}  # group -> its step in the pipeline (RequestMemory reads it)
        self.requests = RequestMemory(self)
        self._task: asyncio.Task | None = None
        self._accepting = True
        self.num_steps = 0
        self.event_loop: asyncio.AbstractEventLoop | None = None

    num_preemptions = property(lambda self: self.requests.num_preemptions)
    recomputed_tokens = property(lambda self: self.requests.recomputed_tokens)

    def start(self) -> None:
        self.event_loop = asyncio.get_running_loop()
        self.pipeline.start()
        self.memory.start()
        self._task = self.event_loop.create_task(self._run(), name="strata-engine-loop")
        self._task.add_done_callback(_log_crash)

    def submit(self, request: Request) -> AsyncIterator[Delta]:
        """Queue a request; returns its delta stream. Raises QueueFullError / ShuttingDownError at once.

        Closing the iterator early (a client that went away) aborts the request.
        """
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down")
        waiting = self.table.waiting
        if len(waiting) >= self.max_queue:
            raise QueueFullError(f"{len(waiting)} requests are already waiting (--max-queue {self.max_queue})")
        waiting.append(request)
        self.table.by_id[request.request_id] = request
        self.metrics.queue_depth.set(len(waiting))
        self.wake.set()
        return self._stream(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its slot is freed before the next step starts."""
        request = self.table.by_id.get(request_id)
        if request is not None and not request.is_finished:
            request.is_cancelled = True
            self.wake.set()

    def stop_admitting(self) -> None:
        """From now on submit() raises ShuttingDownError; queued and running requests go on."""
        self._accepting = False

    async def shutdown(self, timeout_s: float) -> None:
        """Stop admitting, let running requests finish for up to timeout_s, then cancel the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self.table.by_id and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.cancel_all()
        while self.table.by_id and self._task and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task:
            self._task.cancel()
        await asyncio.gather(*self.in_flight.values(), return_exceptions=True)
        await self.pipeline.close()  # drains the stages in order
        await self.memory.close()
        if self.disk is not None and self.cache.enabled:
            flush_to_disk(self.cache)  # the next start reuses every conversation still cached

    def cancel_all(self) -> None:
        """Abort every queued and running request (each stream still gets its final delta)."""
        for request in list(self.table.by_id.values()):
            request.is_cancelled = True
        self.wake.set()

    async def resize_device_pool(self, max_blocks: int) -> dict:
        """Set the elastic device pool's ceiling; below its size now, shrink to it (as far as the pool can
        without dropping a cached block: the rest is parked to host RAM, or the shrink stops and says why).
        A queued request of the memory admission: planned and applied at its turn, between steps."""
        if not self.cache.admission.device_reserved_blocks:
            raise ValueError("the device KV pool is fixed: start the server with --kv-cache-mib MIN:MAX to make it "
                             "elastic")
        state = await self.memory.request(lambda: resize_pool(self.memory, max_blocks), "device pool resize")
        if self.integrity_checks:
            self.cache.check_integrity()
        return state

    # GET /slots, /cache, /requests, /pipeline, /get_load: read-only views (scheduler/engine_views.py)
    def slots_snapshot(self) -> list[dict]:
        return [engine_views.slot_info(self, i, r) for i, r in enumerate(self.table.slots)]

    def cache_snapshot(self) -> dict:
        return engine_views.cache_snapshot(self)

    def requests_snapshot(self, conversation: str | None = None, limit: int = 256) -> list[dict]:
        return self.output.history.snapshot(conversation, limit)

    def pipeline_snapshot(self) -> dict:
        return engine_views.pipeline_snapshot(self)

    def load_snapshot(self) -> dict:
        return engine_views.load_snapshot(self)

    queue_depth = property(lambda self: len(self.table.waiting))

    @property
    def device_pool_tokens(self) -> int:
        """Tokens the device KV pool holds now (an elastic pool: its current size, not its ceiling)."""
        return self.cache.num_blocks * self.runner.block_size

    # -- the loop -----------------------------------------------------------------------------------
    async def _stream(self, request: Request) -> AsyncIterator[Delta]:
        try:
            while True:
                delta = await request.outbox.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not request.is_finished:
                self.abort(request.request_id)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Woken by submit/abort, every group step that ends and every queued memory request served
            # (inline during this scan too: then it scans again, e.g. for a ceiling raised mid-scan).
            self.wake.clear()
            preemptions = self.num_preemptions
            self._write_behind_turn()
            self._drop_cancelled()
            self.admit()
            for group in range(self.num_groups):
                if group not in self.in_flight:
                    work = self.requests.schedule(group)
                    if work:
                        self.in_flight[group] = loop.create_task(self._step_group(group, work))
            if self.num_preemptions > preemptions and not self.in_flight:
                await asyncio.sleep(0)  # preempted in this scan, nothing in flight to wake us: admit again
                continue
            if self.write_behind is not None and self.write_behind.has_work:
                with contextlib.suppress(asyncio.TimeoutError):  # no event for a while: a write-behind turn
                    await asyncio.wait_for(self.wake.wait(), WRITE_BEHIND_TICK_S)
            else:
                await self.wake.wait()

    def _write_behind_turn(self) -> None:
        """Every WRITE_BEHIND_TICK_S, busy or idle, write a bounded share of the unsaved blocks to disk."""
        wb = self.write_behind
        if wb is not None and wb.has_work and time.monotonic() - wb.last_tick >= WRITE_BEHIND_TICK_S:
            wb.tick()

    async def _step_group(self, group: int, work: list[tuple[Request, int]]) -> None:
        """One step of one group through the pipeline, then its tokens out; a failure fails only this group."""
        started = time.perf_counter()
        try:
            results = await self.pipeline.run(group, work)
        except Exception as exc:  # a failed step fails its requests, never the server
            log.error("engine step failed for group %d: %s", group, exc,
                      extra={"fields": {"group": group, "error": str(exc)}})
            for request, _ in work:
                self._finish(request, "error", error=f"engine step failed: {exc}")
        else:
            kind = "prefill" if any(n > 1 for _, n in work) else "decode"
            self.metrics.step_seconds.labels(kind).observe(time.perf_counter() - started)
            self.num_steps += 1
            self.hybrid.take_checkpoints(work)
            self._postprocess(results)
            if self.integrity_checks:
                self.cache.check_integrity()
                self.runner.check_stages()
        finally:
            del self.in_flight[group]
            self.wake.set()

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.table.waiting if r.is_cancelled]:
            self.table.waiting.remove(request)
            self._finish(request, "abort")
        for request in [r for r in self.table.running() if r.is_cancelled]:
            if request.group not in self.in_flight:  # in flight: its blocks are being written
                self._finish(request, "abort")

    def admit(self) -> None:
        """Waiting requests into free slots (scheduler/memory/requests.py), then the gauges. The loop calls it
        before every step; a test calls it to see one admission without running a step."""
        self.requests.admit(lambda request, error: self._finish(request, "error", error=error))
        self.metrics.queue_depth.set(len(self.table.waiting))
        self.metrics.slots_in_use.set(self.table.num_running)
        self.metrics.observe_cache(self.cache.usage())
        if self.integrity_checks:
            self.cache.check_integrity()

    def _postprocess(self, results: list[StepResult]) -> None:
        now = time.perf_counter()
        for result in results:
            request = result.request
            if result.token is None:
                self.output.report_progress(request, now)
                continue
            if request.prefill_done_s is None:
                request.prefill_done_s = now
                self.metrics.ttft_seconds.observe(now - request.arrival_s)
            finish_reason = self.output.accept_token(request, result)
            if finish_reason is not None:
                self._finish(request, finish_reason)
            else:
                request.seq.token_ids.append(result.token)

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        request.is_finished = True
        if request.slot_id is not None:
            # After a failed step the state may be half updated: no checkpoint from it.
            self.requests.release(request, self.hybrid.final_state(request) if reason != "error" else None)
            self.table.vacate(request)
        self.table.by_id.pop(request.request_id, None)
        self.output.finish(request, reason, error)
        if request.conversation_key:
            self.conversations.record(request.conversation_key, request.request_id, request.prompt_len,
                                      request.cached_tokens)
        engine_views.observe_finish(self.metrics, request, reason, self.table.num_running)
