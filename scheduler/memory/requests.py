"""The requests' side of the memory admission: blocks for a request's first step, for each next step, and
back to the cache at the end, all as plans granted through the memory admission (memory/service.py).

    admit     waiting -> slot: its longest cached prefix (restored if parked) + blocks for one chunk
    schedule  a group's next step (scheduler/step_plan.py): every decoding request's next token, then prompt
              chunks within the step's budget, each with its blocks reserved first
    reserve   each step: blocks for its next n tokens; short even after parking cached blocks: preempt
              running requests, newest first (their computed blocks join the tree; they wait at the head
              of the queue and resume by restore, never by recompute)
    release   finished (or preempted): its computed tokens' blocks join the tree, unpinned

Runs on the event loop between steps; each plan is computed, granted and applied without an await.
"""
from __future__ import annotations

import asyncio
import logging
import time

from engine.kv import blocks_needed
from engine.sampling import Sampler
from engine.sequence import Sequence
from scheduler.cache.explain import explain_unseen
from scheduler.request import Request
from scheduler.step_plan import compose_step

log = logging.getLogger("strata.scheduler")
RETRY_S = 0.005  # a refused grant is asked again this soon


def step_needs_plan(allocation, num_tokens: int, block_size: int) -> bool:
    """Whether a table must grow to hold num_tokens (else its plan would be empty, granted as it is)."""
    return blocks_needed(num_tokens, block_size) > len(allocation.block_table)


class RequestMemory:
    """Admission, per-step reservation, preemption and release of the requests in one SlotTable."""

    def __init__(self, engine):
        # Composed from the engine's parts (each with its own state); nothing here is the engine's own.
        self.cache, self.memory, self.table = engine.cache, engine.memory, engine.table
        self.hybrid, self.output, self.conversations = engine.hybrid, engine.output, engine.conversations
        self.block_size, self.prefill_chunk = engine.runner.block_size, engine.prefill_chunk
        self.prefill_step_tokens = engine.prefill_step_tokens
        self.in_flight = engine.in_flight  # group -> its step: those requests' blocks are being written
        self.wake = engine.wake
        self.num_preemptions = 0
        self.recomputed_tokens = 0  # by resumed requests, because a tier dropped what they had computed

    def admit(self, fail) -> None:
        """Move waiting requests into free slots while their first step's plan is granted. `fail(request,
        message)` finishes one that can never fit. A preempted request resumes the same way: its computed
        tokens are in the cache tree, so its match restores them and nothing is recomputed."""
        table, cache = self.table, self.cache
        while table.waiting and table.has_free_slot:
            request = table.waiting[0]
            total = request.prompt_len + request.params.max_tokens
            needed = blocks_needed(total, self.block_size)
            if needed > max(cache.num_blocks, self.memory.admission.device_reserved_blocks):
                table.waiting.popleft()  # can never fit: the API checks this, so this is a bug guard
                fail(request, f"{total} tokens do not fit the KV pool")
                continue
            if needed > max(cache.num_blocks, self.memory.device_reachable_blocks):
                break  # an elastic pool held low for now (POST /cache/device-pool): wait for its ceiling
            tokens = request.seq.token_ids if request.seq is not None else request.prompt_ids
            found = {}
            grant = self.memory.grant(lambda: self._plan_admit(request, tokens, found))
            if not grant.granted:
                if grant.plan is not None:
                    self.retry_soon()  # refused: nothing changed; ask again shortly
                break  # wait for running requests to release blocks
            table.waiting.popleft()
            self._start(request, tokens, found["match"], grant.allocation)

    def _plan_admit(self, request: Request, tokens: list[int], found: dict):
        # The last token is always computed: its logits pick the next token.
        match = self.cache.match(tokens, len(tokens) - 1, salt=request.cache_salt,
                                 conversation=request.conversation_key)
        found["match"] = match
        plan = self._plan_for(match, tokens)
        while plan is None and match.num_tokens and self.table.num_running == 0:
            # Nothing running will free a block (a hybrid model's parked prefix brings its checkpoints back
            # with it, and they may not fit): reuse less rather than wait forever.
            shorter = self.cache.ckpt.shorter(match)
            log.info("request %s: no device room to restore %d matched tokens with their state checkpoints; "
                     "reusing %d", request.request_id, match.num_tokens, shorter.num_tokens,
                     extra={"fields": {"request_id": request.request_id, "matched": match.num_tokens,
                                       "reused": shorter.num_tokens}})
            match = found["match"] = shorter
            plan = self._plan_for(match, tokens)
        return plan

    def _plan_for(self, match, tokens: list[int]):
        """The plan that pins the match and blocks for the first step, with a slot for the checkpoint a
        hybrid model's request takes at its release where there is room for one (None: no room)."""
        first_step = min(len(tokens), match.num_tokens + self.prefill_chunk)
        plan = self.cache.plan_allocate(match, first_step, checkpoints=self.hybrid.reserve_at_admission)
        if plan is None and self.hybrid.reserve_at_admission:  # no room for its checkpoint: go without
            plan = self.cache.plan_allocate(match, first_step)
        return plan

    def _start(self, request: Request, tokens: list[int], match, allocation) -> None:
        if request.seq is not None and request.seq.num_computed > allocation.cached_tokens:
            lost = request.seq.num_computed - allocation.cached_tokens  # only when a lower tier dropped them
            self.recomputed_tokens += lost
            log.warning("request %s resumes recomputing %d tokens the cache lost while it was preempted",
                        request.request_id, lost, extra={"fields": {"request_id": request.request_id,
                                                                    "recomputed": lost}})
        if request.seq is None:
            self.output.report_miss(request, self._explain_miss(request, match, allocation))
            # A state window's tokens are computed again (their K/V is reused): not counted as cached.
            request.cached_tokens = allocation.cached_tokens - allocation.state_window
            request.sampler = Sampler(request.params)
            request.admitted_s = time.perf_counter()
            request.admitted.set()
        request.allocation = allocation
        request.seq = Sequence(list(tokens), allocation.block_table, allocation.cached_tokens)
        self.hybrid.admit(request, match)  # its state slot, loaded from the checkpoint the match ends at
        self.table.place(request)

    def _explain_miss(self, request: Request, match, allocation) -> dict | None:
        """Why the cache reused no more of a new request's prompt; None when it never held more. A named
        conversation this replica never served is explained as such first: its prompt also diverges from
        whatever else is cached here, but that is not why it missed."""
        in_cache = self.cache.explain_miss(request.prompt_ids, match)  # always: it counts hits and misses
        key = request.conversation_key
        served_here = key is not None and key in self.conversations
        return explain_unseen(key, served_here, request.earlier_turns, match,
                              allocation.reused_by_tier.get("disk", 0)) or in_cache

    def schedule(self, group: int) -> list[tuple[Request, int]]:
        """One group's step as compose_step plans it (every decode, then prompt chunks within the budget), for
        those whose blocks were reserved (the others sit the step out)."""
        work = compose_step(self.table.members(group), self.prefill_chunk, self.prefill_step_tokens)
        work = [(r, n) for r, n in work if self.reserve(r, n)]
        work = [(r, n) for r, n in work if r.slot_id is not None]  # a later reservation may have preempted it
        self.hybrid.before_step(work)  # hybrid models: capture the states at checkpoint positions
        for request, n in work:
            if request.constraint is not None and n == request.seq.num_pending:  # this step samples its token
                request.constraint.begin_mask()  # computed beside the forward pass; sample_step waits for it
        return work

    def reserve(self, request: Request, n: int) -> bool:
        """Blocks for the request's next n tokens. When the pool is short, the plan parks unpinned cached
        blocks; when even that cannot make room, running requests are preempted, newest first. False: the
        request sits this step out (preempted, or its grant was refused). A step its table already holds
        (most decode steps) needs no plan: nothing to plan, grant or apply, and no queued request is served
        ahead of it (it takes no memory)."""
        if request.slot_id is None:  # preempted by an earlier reservation of this same step
            return False
        if not step_needs_plan(request.allocation, request.seq.num_computed + n, self.block_size) \
                and not self.hybrid.checkpoints_after(request, n):
            return True
        while request.slot_id is not None:
            grant = self.memory.grant(lambda: self._plan_step(request, n))
            if grant.granted:
                return True
            if grant.plan is not None:
                self.retry_soon()  # refused: this request sits the step out, nothing changed
                return False
            if request.allocation.checkpoints_reserved:  # no room for those it holds: give them up
                self.cache.ckpt.give_up_pending(request.allocation)
                continue
            idle = [r for r in self.table.running() if r.group not in self.in_flight]
            self.preempt(max(idle, key=lambda r: r.admitted_s))  # the request itself is one of them
        return False

    def _plan_step(self, request: Request, n: int):
        checkpoints = self.hybrid.checkpoints_after(request, n)
        plan = self.cache.plan_extend(request.allocation, request.seq.num_computed + n, checkpoints=checkpoints)
        if plan is None and checkpoints:  # no room for the step's checkpoints: the step goes without them
            plan = self.cache.plan_extend(request.allocation, request.seq.num_computed + n)
        return plan

    def retry_soon(self) -> None:
        """Wake the engine loop again shortly: a refused grant is asked again (nothing changed meanwhile)."""
        asyncio.get_running_loop().call_later(RETRY_S, self.wake.set)

    def preempt(self, request: Request) -> None:
        """Give a running request's blocks back to the cache (its computed tokens join the tree, where value
        order parks them to host RAM under pressure) and put it at the head of the queue."""
        self.release(request, final_state=self.hybrid.final_state(request), kind="preempt")
        self.table.vacate(request)
        request.allocation = None
        request.preemptions += 1
        self.num_preemptions += 1
        self.table.waiting.appendleft(request)
        log.info("preempted request %s at %d computed tokens: the KV pool is short", request.request_id,
                 request.seq.num_computed, extra={"fields": {"request_id": request.request_id,
                                                             "computed": request.seq.num_computed}})

    def release(self, request: Request, final_state, kind: str = "release") -> None:
        """The request's blocks back to the cache tree (a release is never refused), its state slot freed."""
        seq = request.seq
        grant = self.memory.grant(lambda: self.cache.plan_release(seq.token_ids, seq.num_computed,
                                                                  request.allocation, kind=kind,
                                                                  final_state=final_state))
        assert grant.granted, f"a {kind} is never refused"
        self.hybrid.release(request)
