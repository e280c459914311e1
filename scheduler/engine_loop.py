"""The engine loop: continuous batching over slots, on the server's one event loop.

The running requests are divided into --batch-groups groups (a group is a list of slot rows, never a
padded range, so every slot keeps its cache whatever the grouping). Each group's step packs its decoding
requests' next tokens plus at most one prefill chunk into one batched forward, so a long prompt delays the
others' decode by at most one chunk. Steps run through the pipeline stages of a layer split
(scheduler/pipeline.py), each stage on a worker of its own, while the event loop keeps serving HTTP; with
several groups the stages work on different groups at once. Everything else (admission, detokenisation,
stop strings, grammar state, finishing) happens on the loop between a group's steps; a constrained request's
next-token mask is begun when its step is scheduled, so it is computed beside the forward pass.

    submit(request) -> async iterator of Delta      abort(request_id)      shutdown(timeout_s)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import AsyncIterator

from engine.kv import blocks_needed
from engine.sampling import Sampler
from engine.sequence import ModelRunner, Sequence
from engine.tokenizer import Tokenizer
from scheduler.block_mover import EngineBlockMover
from scheduler.cache_persistence import flush_to_disk, load_disk_index
from scheduler.cache_explain import explain_unseen
from scheduler.conversation_activity import ACTIVE_WINDOW_S
from scheduler.hybrid_steps import HybridSteps, create_checkpoints, load_checkpoint_index
from scheduler.conversations import ConversationLog
from scheduler.disk_tier import DiskTier
from scheduler.device_pool import SEGMENT_BLOCKS as DEVICE_SEGMENT_BLOCKS
from scheduler.write_behind import TICK_S as WRITE_BEHIND_TICK_S
from scheduler.write_behind import WriteBehind
from scheduler.memory_admission import MemoryAdmission, MemoryGrants
from scheduler.metrics import Metrics
from scheduler.output import OutputProcessor
from scheduler.pipeline import Pipeline
from scheduler.prefix_cache import PrefixCache
from scheduler.request import Delta, Request
from scheduler.step import StepResult, sample_step

log = logging.getLogger("strata.scheduler")


class QueueFullError(RuntimeError):
    """The wait queue is at --max-queue; the API answers 503 with Retry-After."""


class ShuttingDownError(RuntimeError):
    """The server is stopping and admits nothing new."""


class EngineLoop:
    """Owns the slots, the wait queue, the batch groups and the pipeline of one model."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, num_slots: int, prefill_chunk: int,
                 max_queue: int, metrics: Metrics | None = None, progress_interval_s: float = 5.0,
                 prefix_cache: bool = True, integrity_checks: bool = False, disk: DiskTier | None = None,
                 batch_groups: int = 1, admission: MemoryAdmission | None = None,
                 conversation_active_s: float = ACTIVE_WINDOW_S, write_behind_mib_s: float = 0,
                 device_min_blocks: int | None = None, state_checkpoint_every: int = 8):
        self.runner = runner
        runner.claim_blocks("conversation cache")  # one owner of block ids: the cache's allocator
        self.disk = disk
        # Without an admission the host tier is what the runner committed at start, fixed.
        admission = admission or MemoryAdmission(runner.host_layout.num_blocks, runner.layout.bytes_per_block)
        assert admission.host_committed_blocks == runner.host_layout.num_blocks, "runner and admission disagree"
        # An elastic device pool starts at device_min_blocks and grows up to every id the runner reserved.
        if device_min_blocks is not None and device_min_blocks < runner.layout.num_blocks:
            admission.set_device_pool(device_min_blocks, runner.layout.num_blocks, DEVICE_SEGMENT_BLOCKS)
        self.cache = PrefixCache(device_min_blocks or runner.layout.num_blocks, runner.block_size, enabled=prefix_cache,
                                 host_blocks=admission.host_budget_blocks,
                                 disk_blocks=disk.capacity_blocks if disk else 0,
                                 mover=EngineBlockMover(runner, disk), block_bytes=runner.layout.bytes_per_block,
                                 admission=admission, active_window_s=conversation_active_s,
                                 checkpoints=create_checkpoints(runner, disk, state_checkpoint_every))
        if disk is not None and prefix_cache:
            load_disk_index(self.cache, disk.scan())
            load_checkpoint_index(self.cache)
        self.hybrid = HybridSteps(runner, self.cache)  # recurrent states of a hybrid model; no-ops otherwise
        # Blocks reach the disk while serving, so a kill -9 loses seconds of work, not the whole cache.
        self.write_behind = WriteBehind(self.cache, runner.layout.bytes_per_block, write_behind_mib_s) \
            if disk is not None and prefix_cache and write_behind_mib_s > 0 else None
        self.memory = MemoryGrants(self.cache)
        self.integrity_checks = integrity_checks  # tests: check the cache after every admission and step
        self.num_slots = num_slots
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.output = OutputProcessor(tokenizer, progress_interval_s)
        self.conversations = ConversationLog()  # named by the clients, for /cache
        self._slots: list[Request | None] = [None] * num_slots
        self._waiting: deque[Request] = deque()
        self._by_id: dict[str, Request] = {}
        self._wake = asyncio.Event()
        self.num_groups = max(1, min(batch_groups, num_slots))
        self.pipeline = Pipeline(runner, sample_step, self.metrics)
        self._in_flight: dict[int, asyncio.Task] = {}  # group -> its step in the pipeline
        self._task: asyncio.Task | None = None
        self._accepting = True
        self.num_steps = 0
        self.num_preemptions = 0
        self.recomputed_tokens = 0  # by resumed requests, because a tier dropped what they had computed
        self.event_loop: asyncio.AbstractEventLoop | None = None

    # -- public interface ---------------------------------------------------------------------------
    def start(self) -> None:
        self.event_loop = asyncio.get_running_loop()
        self.pipeline.start()
        self._task = self.event_loop.create_task(self._run(), name="strata-engine-loop")

    def submit(self, request: Request) -> AsyncIterator[Delta]:
        """Queue a request; returns its delta stream. Raises QueueFullError / ShuttingDownError at once.

        Closing the iterator early (a client that went away) aborts the request.
        """
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down")
        if len(self._waiting) >= self.max_queue:
            raise QueueFullError(f"{len(self._waiting)} requests are already waiting (--max-queue {self.max_queue})")
        self._waiting.append(request)
        self._by_id[request.request_id] = request
        self.metrics.queue_depth.set(len(self._waiting))
        self._wake.set()
        return self._stream(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its slot is freed before the next step starts."""
        request = self._by_id.get(request_id)
        if request is not None and not request.is_finished:
            request.is_cancelled = True
            self._wake.set()

    def stop_admitting(self) -> None:
        """From now on submit() raises ShuttingDownError; queued and running requests go on."""
        self._accepting = False

    async def shutdown(self, timeout_s: float) -> None:
        """Stop admitting, let running requests finish for up to timeout_s, then cancel the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._by_id and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.cancel_all()
        while self._by_id and self._task and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task:
            self._task.cancel()
        await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
        await self.pipeline.close()  # drains the stages in order
        if self.disk is not None and self.cache.enabled:
            flush_to_disk(self.cache)  # the next start reuses every conversation still cached

    def cancel_all(self) -> None:
        """Abort every queued and running request (each stream still gets its final delta)."""
        for request in list(self._by_id.values()):
            request.is_cancelled = True
        self._wake.set()

    def resize_device_pool(self, max_blocks: int) -> dict:
        """Set the elastic device pool's ceiling; below its size now, shrink to it (as far as the pool can
        without dropping a cached block: the rest is parked to host RAM, or the shrink stops and says why).
        On the event loop, between plans, like every other cache move."""
        admission = self.cache.admission
        if not admission.device_reserved_blocks:
            raise ValueError("the device KV pool is fixed: start the server with --kv-cache-max-mib to make it elastic")
        ceiling = admission.set_device_ceiling(max_blocks)
        stopped_by = ""
        if ceiling < self.cache.num_blocks:
            plan = self.cache.plan_shrink(ceiling)
            if admission.grant(plan):
                self.cache.apply(plan)
                stopped_by = plan.stopped_by
            else:
                self.cache.stats["refused_plans"] += 1
                stopped_by = "the memory admission refused the moves"
            admission.set_device_ceiling(max(ceiling, self.cache.num_blocks))  # it does not grow back by itself
        if self.integrity_checks:
            self.cache.check_integrity()
        self._wake.set()  # a larger ceiling may admit a waiting request now
        return {"device_blocks": self.cache.num_blocks, "ceiling_blocks": admission.device_ceiling_blocks,
                "min_blocks": admission.device_min_blocks, "reserved_blocks": admission.device_reserved_blocks,
                "stopped_by": stopped_by}

    def slots_snapshot(self) -> list[dict]:
        """State of every slot for GET /slots."""
        return [self._slot_info(i, r) for i, r in enumerate(self._slots)]

    def cache_snapshot(self) -> dict:
        """The conversation cache for GET /cache: per tier cached / in use / total (host: budget, committed,
        used), moves and drops, and each conversation holding cached blocks (latest first): its tokens per
        tier, whether it is active, its last use, and for those clients named, their turns' reuse."""
        usage = self.cache.usage()
        usage["block_size"] = self.cache.block_size
        layout = self.runner.layout
        usage["kv"] = {"type": layout.kv_type, "bytes_per_token": layout.bytes_per_token,
                       "bytes_per_block": layout.bytes_per_block}
        usage["conversations"] = self.conversations.snapshot(self.cache.activity.snapshot(self.cache.block_size))
        return usage

    def pipeline_snapshot(self) -> dict:
        """Stages (busy time, queue depth) and groups (row maps, where each is) for GET /pipeline."""
        groups = [{"group": g, "rows": [r.slot_id for r in self._members(g)], "stage": self.pipeline.where(g)}
                  for g in range(self.num_groups)]
        return {"stages": self.pipeline.snapshot(), "groups": groups}

    def load_snapshot(self) -> dict:
        """Requests running and waiting, and the tokens they hold or will need (KV blocks of the running
        ones, prompts of the waiting ones): what a router balances on (GET /get_load)."""
        running = [r for r in self._slots if r is not None]
        held = sum(len(r.seq.block_table) * self.runner.block_size for r in running if r.seq is not None)
        return {"running": len(running), "waiting": len(self._waiting),
                "tokens": held + sum(r.prompt_len for r in self._waiting)}

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

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
            preemptions = self.num_preemptions
            self._write_behind_turn()
            self._drop_cancelled()
            self._admit()
            for group in range(self.num_groups):
                if group not in self._in_flight:
                    work = self._schedule(group)
                    if work:
                        self._in_flight[group] = loop.create_task(self._step_group(group, work))
            if self.num_preemptions > preemptions and not self._in_flight:
                await asyncio.sleep(0)  # preempted in this scan, nothing in flight to wake us: admit again
                continue
            # Woken by submit/abort and by every group step that ends; no await since the scan above, so
            # nothing can have set the event in between.
            self._wake.clear()
            if self.write_behind is not None and self.write_behind.has_work:
                with contextlib.suppress(asyncio.TimeoutError):  # no event for a while: a write-behind turn
                    await asyncio.wait_for(self._wake.wait(), WRITE_BEHIND_TICK_S)
            else:
                await self._wake.wait()

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
            del self._in_flight[group]
            self._wake.set()

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._waiting if r.is_cancelled]:
            self._waiting.remove(request)
            self._finish(request, "abort")
        for request in [r for r in self._slots if r is not None and r.is_cancelled]:
            if request.group not in self._in_flight:  # in flight: its blocks are being written
                self._finish(request, "abort")

    def _admit(self) -> None:
        """Move waiting requests into free slots: reuse their longest cached prefix, blocks for the first step.

        A preempted request (back at the head of the queue) resumes the same way: its computed tokens are
        in the cache tree, so its match restores them and nothing is recomputed."""
        while self._waiting and None in self._slots:
            request = self._waiting[0]
            tokens = request.seq.token_ids if request.seq is not None else request.prompt_ids
            # The last token is always computed: its logits pick the next token.
            total = request.prompt_len + request.params.max_tokens
            needed = blocks_needed(total, self.runner.block_size)
            if needed > max(self.cache.num_blocks, self.cache.admission.device_reserved_blocks):
                self._waiting.popleft()  # can never fit: the API checks this, so this is a bug guard
                self._finish(request, "error", error=f"{total} tokens do not fit the KV pool")
                continue
            if needed > max(self.cache.num_blocks, self.cache.admission.device_ceiling_blocks):
                break  # an elastic pool held low for now (POST /cache/device-pool): wait for its ceiling
            match = self.cache.match(tokens, len(tokens) - 1, salt=request.cache_salt,
                                     conversation=request.conversation_key)
            plan = self._plan_admission(match, tokens)
            while plan is None and match.num_tokens and not any(self._slots) and not self._in_flight:
                # Nothing running will free a block (a hybrid model's parked prefix brings its checkpoints
                # back with it, and they may not fit): reuse less rather than wait forever.
                shorter = self.cache.ckpt.shorter(match)
                log.info("request %s: no device room to restore %d matched tokens with their state checkpoints; "
                         "reusing %d", request.request_id, match.num_tokens, shorter.num_tokens,
                         extra={"fields": {"request_id": request.request_id, "matched": match.num_tokens,
                                           "reused": shorter.num_tokens}})
                match = shorter
                plan = self._plan_admission(match, tokens)
            allocation = self.memory.grant(plan)
            if allocation is None:
                if plan is not None:
                    self._retry_soon()  # refused: nothing changed; ask again shortly
                break  # wait for running requests to release blocks
            self._waiting.popleft()
            if request.seq is not None and request.seq.num_computed > allocation.cached_tokens:
                lost = request.seq.num_computed - allocation.cached_tokens  # only when a lower tier dropped them
                self.recomputed_tokens += lost
                log.warning("request %s resumes recomputing %d tokens the cache lost while it was preempted",
                            request.request_id, lost, extra={"fields": {"request_id": request.request_id,
                                                                        "recomputed": lost}})
            if request.seq is None:
                self.output.report_miss(request, self._explain_miss(request, match, allocation))
                request.cached_tokens = allocation.cached_tokens
                request.sampler = Sampler(request.params)
                request.admitted_s = time.perf_counter()
            request.allocation = allocation
            request.seq = Sequence(list(tokens), allocation.block_table, allocation.cached_tokens)
            self.hybrid.admit(request, match)  # its state slot, loaded from the checkpoint the match ends at
            request.slot_id = self._slots.index(None)
            # The group with the fewest members, so the groups stay balanced and every stage has work.
            request.group = min(range(self.num_groups), key=lambda g: (len(self._members(g)), g))
            self._slots[request.slot_id] = request
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.slots_in_use.set(sum(r is not None for r in self._slots))
        self.metrics.observe_cache(self.cache.usage())
        if self.integrity_checks:
            self.cache.check_integrity()

    def _plan_admission(self, match, tokens: list[int]):
        """The plan that pins the match and blocks for the first step, with a slot for the checkpoint a
        hybrid model's request takes at its release where there is room for one (None: no room)."""
        first_step = min(len(tokens), match.num_tokens + self.prefill_chunk)
        plan = self.cache.plan_allocate(match, first_step, checkpoints=self.hybrid.reserve_at_admission)
        if plan is None and self.hybrid.reserve_at_admission:  # no room for its checkpoint: go without
            plan = self.cache.plan_allocate(match, first_step)
        return plan

    def _explain_miss(self, request: Request, match, allocation) -> dict | None:
        """Why the cache reused no more of a new request's prompt; None when it never held more. A named
        conversation this replica never served is explained as such first: its prompt also diverges from
        whatever else is cached here, but that is not why it missed."""
        in_cache = self.cache.explain_miss(request.prompt_ids, match)  # always: it counts hits and misses
        key = request.conversation_key
        served_here = key is not None and key in self.conversations
        return explain_unseen(key, served_here, request.earlier_turns, match,
                              allocation.reused_by_tier.get("disk", 0)) or in_cache

    def _reserve(self, request: Request, n: int) -> bool:
        """Blocks for the request's next n tokens. When the pool is short, the plan parks unpinned cached
        blocks; when even that cannot make room, running requests are preempted, newest first. False: the
        request sits this step out (preempted, or its grant was refused)."""
        while request.slot_id is not None:
            checkpoints = self.hybrid.checkpoints_after(request, n)
            plan = self.cache.plan_extend(request.allocation, request.seq.num_computed + n, checkpoints=checkpoints)
            if plan is None and checkpoints:  # no room for the step's checkpoints: the step goes without them
                plan = self.cache.plan_extend(request.allocation, request.seq.num_computed + n)
            if plan is None and request.allocation.checkpoints_reserved:  # nor for those it holds: give them up
                self.cache.ckpt.give_up_pending(request.allocation)
                continue
            if plan is not None:
                if self.memory.grant(plan) is not None:
                    return True
                self._retry_soon()  # refused: this request sits the step out, nothing changed
                return False
            idle = [r for r in self._slots if r is not None and r.group not in self._in_flight]
            self._preempt(max(idle, key=lambda r: r.admitted_s))  # the request itself is one of them
        return False

    def _retry_soon(self) -> None:
        asyncio.get_running_loop().call_later(0.005, self._wake.set)

    def _preempt(self, request: Request) -> None:
        """Give a running request's blocks back to the cache (its computed tokens join the tree, where value
        order parks them to host RAM under pressure) and put it at the head of the queue."""
        plan = self.cache.plan_release(request.seq.token_ids, request.seq.num_computed, request.allocation,
                                       kind="preempt", final_state=self.hybrid.final_state(request))
        assert self.memory.grant(plan) is not None, "a release is never refused"
        self.hybrid.release(request)
        self._slots[request.slot_id] = None
        request.slot_id, request.allocation = None, None
        request.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request)
        log.info("preempted request %s at %d computed tokens: the KV pool is short", request.request_id,
                 request.seq.num_computed, extra={"fields": {"request_id": request.request_id,
                                                             "computed": request.seq.num_computed}})

    def _members(self, group: int) -> list[Request]:
        """The group's row map: its running requests (slots), in slot order."""
        return [r for r in self._slots if r is not None and r.group == group]

    def _schedule(self, group: int) -> list[tuple[Request, int]]:
        """Every decoding request's next token, plus one prefill chunk of the oldest admitted prompt, of one
        group."""
        running = sorted(self._members(group), key=lambda r: r.admitted_s)
        work = [(r, 1) for r in running if not r.is_prefilling]
        prefilling = next((r for r in running if r.is_prefilling), None)
        if prefilling is not None:
            work.append((prefilling, min(self.prefill_chunk, prefilling.seq.num_pending)))
        work = [(r, n) for r, n in work if self._reserve(r, n)]
        work = [(r, n) for r, n in work if r.slot_id is not None]  # a later reservation may have preempted it
        self.hybrid.before_step(work)  # hybrid models: capture the states at checkpoint positions
        for request, n in work:
            if request.constraint is not None and n == request.seq.num_pending:  # this step samples its token
                request.constraint.begin_mask()  # computed beside the forward pass; sample_step waits for it
        return work

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
            self._slots[request.slot_id] = None
            # After a failed step the state may be half updated: no checkpoint from it.
            final = self.hybrid.final_state(request) if reason != "error" else None
            self.memory.grant(self.cache.plan_release(request.seq.token_ids, request.seq.num_computed,
                                                      request.allocation, final_state=final))
            self.hybrid.release(request)
        self._by_id.pop(request.request_id, None)
        self.output.finish(request, reason, error)
        if request.conversation_key:
            self.conversations.record(request.conversation_key, request.request_id, request.prompt_len,
                                      request.cached_tokens)
        m = self.metrics
        m.requests.labels(reason).inc()
        m.prompt_tokens.inc(request.prompt_len)
        m.reused_tokens.inc(request.cached_tokens)
        m.computed_tokens.inc(request.prompt_len - request.cached_tokens if request.prefill_done_s else 0)
        m.generated_tokens.inc(len(request.output_ids))
        m.request_seconds.observe(time.perf_counter() - request.arrival_s)
        m.slots_in_use.set(sum(r is not None for r in self._slots))

    def _slot_info(self, slot_id: int, request: Request | None) -> dict:
        if request is None:
            return {"id": slot_id, "state": "idle"}
        stage = self.pipeline.where(request.group)
        stats = self.pipeline.stats[stage] if stage is not None else None
        return {
            "id": slot_id,
            "state": "prefill" if request.is_prefilling else "decode",
            "request_id": request.request_id,
            "group": request.group,
            "pipeline_stage": stage,  # where this slot's group step is now, with that stage's load
            "stage_queue_depth": stats.queue_depth if stats else None,
            "stage_busy_seconds": round(stats.busy_seconds, 3) if stats else None,
            "prompt_tokens": request.prompt_len,
            "tokens_computed": request.seq.num_computed,
            "generated": len(request.output_ids),
            "kv_blocks": len(request.seq.block_table),
            "cached_tokens": request.cached_tokens,
            "tokens_held": len(request.seq.block_table) * self.runner.block_size,
        }
