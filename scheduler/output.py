"""Turning sampled tokens into the deltas a client sees, and the per-request log lines.

Runs on the event loop: incremental detokenisation (never splitting a UTF-8 character), stop strings
(never emitting half of one), EOS, max_tokens, and the one summary line per request that operators
grep for: `prompt N tokens = R reused (device D, host H, disk K) + M read in T ms (X tok/s), G generated`.
"""
from __future__ import annotations

import logging
import time

from engine.reply_text import ReplyText
from engine.tokenizer import Tokenizer
from scheduler.request import Delta, Request
from scheduler.request_history import RequestHistory, miss_summary
from scheduler.step import StepResult

log = logging.getLogger("strata.requests")

PROGRESS_INTERVAL_S = 5.0  # seconds between progress lines of a long prefill (--progress-interval-s)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, progress_interval_s: float = PROGRESS_INTERVAL_S,
                 hidden_token_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.hidden_token_ids = hidden_token_ids  # control tokens whose text a reply leaves out
        self.progress_interval_s = progress_interval_s
        self._text_state: dict[str, ReplyText] = {}
        self._misses: dict[str, dict] = {}  # request id -> its miss, until the request's record is written
        self.history = RequestHistory()  # the last finished requests (GET /requests, the dashboard)

    def accept_token(self, request: Request, result: StepResult) -> str | None:
        """Record a sampled token and stream its text; returns a finish reason when the request is done
        (the rules: engine/reply_text.py)."""
        reply = self._state(request)
        if reply.ends_on(result.token):
            return "stop"
        request.output_ids.append(result.token)
        constraint = request.constraint
        if constraint is not None:
            constraint.accept(result.token)
        # A complete grammar ends the reply with this token: no EOS-only step, so the held-back text goes now.
        grammar_done = constraint is not None and constraint.is_finished
        text = reply.push(result.token, grammar_done)
        logprobs = [result.logprob] if result.logprob is not None else []
        if text or logprobs or not reply.stopped:
            request.outbox.put_nowait(Delta(text=text, token_ids=[result.token], logprobs=logprobs))
        return reply.finish_reason(len(request.output_ids), grammar_done)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """Flush held-back text, send the final delta with usage, and log the request's summary."""
        reply = self._text_state.pop(request.request_id, None)
        # a reply ending on EOS too: a held-back "#" of a "###" stop string is text
        tail = reply.flush() if reply is not None else ""
        usage = request.usage()
        request.outbox.put_nowait(Delta(text=tail, finish_reason=reason, usage=usage, error=error))
        self._log_summary(request, reason, error)

    def report_progress(self, request: Request, now: float) -> None:
        """At most every progress_interval_s, say how far a long prompt has been read."""
        since = request.last_progress_s or request.admitted_s or now
        if now - since < self.progress_interval_s:
            return
        request.last_progress_s = now
        log.info(
            "reading the prompt: %d of %d tokens, %.0f s so far",
            request.seq.num_computed, request.prompt_len, now - (request.admitted_s or now),
            extra={"fields": {"request_id": request.request_id}},
        )

    def report_miss(self, request: Request, miss: dict | None) -> None:
        """One line when the cache once held more of this prompt than it reused: where and why."""
        if miss is None:
            return
        position = miss["position"]
        described = request.describe_position(position) if request.describe_position else ""
        self._misses[request.request_id] = miss_summary(miss, described)
        where = f" ({described})" if described else ""
        named = f"conversation {request.conversation_key!r}: " if request.conversation_key else ""
        base = {"request_id": request.request_id, "position": position}
        if request.conversation_key:
            base["conversation"] = request.conversation_key
        if miss["cause"] == "unseen":
            fields = {**base, "miss": "unseen", "earlier_turns": miss["earlier_turns"], "disk": miss["disk_tokens"]}
            if miss["disk_tokens"]:
                log.info("%snot served by this replica since it started, yet the prompt carries %d earlier "
                         "turns: the cache matched %d tokens%s, %d of them from its disk tier (computed here "
                         "before a restart); the rest, computed on another replica meanwhile, is read again", named,
                         miss["earlier_turns"], position, where, miss["disk_tokens"], extra={"fields": fields})
            else:
                log.info("%sno replica held it here: this replica never served the conversation since it "
                         "started, yet the prompt carries %d earlier turns (computed on another replica, which "
                         "may have stopped, or here before a restart); it matched only %d tokens%s shared with other prompts, and the "
                         "rest is read again", named, miss["earlier_turns"], position, where,
                         extra={"fields": fields})
        elif miss["cause"] == "evicted":
            age_s = time.time() - miss["evicted_at"]
            log.info("%sprompt diverged from the cache at token %d%s: the rest was evicted from the %s tier "
                     "%.0f s ago (%s)", named, position, where, miss["tier"], age_s, miss["reason"],
                     extra={"fields": {**base, "miss": "evicted"}})
        elif miss["cause"] == "state_window":  # a hit, explained: engine/state_window.py
            nearest = f"the nearest state checkpoint is at token {miss['checkpoint']}" if miss["checkpoint"] \
                else "no state checkpoint before it"
            log.info("%srestored the K/V of %d cached tokens (state recomputed from a %d-token window at %d%s; "
                     "%s)", named, position, miss["window"], position, f", in {described}" if described else "",
                     nearest,
                     extra={"fields": {**base, "miss": "state_window", "window": miss["window"],
                                       "checkpoint": miss["checkpoint"]}})
        elif miss["cause"] == "no_checkpoint":
            log.info("%sprompt matched %d cached tokens, but the nearest state checkpoint is at token %d%s: "
                     "recomputing from there (a hybrid model's recurrent state cannot be cut from a later one; "
                     "--state-checkpoint-every keeps more)", named, miss["kv_tokens"], position, where,
                     extra={"fields": {**base, "miss": "no_checkpoint", "kv_tokens": miss["kv_tokens"]}})
        else:
            log.info("%sprompt diverged from the nearest cached sequence (%s) at token %d%s", named,
                     miss["conversation"], position, where, extra={"fields": {**base, "miss": "diverged"}})

    def _state(self, request: Request) -> ReplyText:
        state = self._text_state.get(request.request_id)
        if state is None:
            state = ReplyText(self.tokenizer, request.params, hidden_ids=self.hidden_token_ids)
            self._text_state[request.request_id] = state
        return state

    def _log_summary(self, request: Request, reason: str, error: str | None) -> None:
        reused = request.cached_tokens
        # A request that ends inside its prompt (aborted, preempted for good, failed) read what it computed;
        # those tokens stay cached, and the next try of the same prompt reuses them.
        done = request.prompt_len if request.prefill_done_s else min(request.prompt_len, getattr(
            request.seq, "num_computed", 0))
        computed = max(0, done - reused)
        read_ms = ((request.prefill_done_s or time.perf_counter()) - (request.admitted_s or request.arrival_s)) * 1e3
        rate = computed / (read_ms / 1e3) if read_ms > 0 else 0.0
        tiers = request.allocation.reused_by_tier if request.allocation is not None else {}
        device, host, disk = (tiers.get(t, 0) for t in ("device", "host", "disk"))
        fields = {
            "request_id": request.request_id, "finish_reason": reason, "prompt_tokens": request.prompt_len,
            "reused_tokens": reused, "reused_device": device, "reused_host": host, "reused_disk": disk,
            "computed_tokens": computed, "generated_tokens": len(request.output_ids), "tools": request.num_tools,
            "queue_ms": round(((request.admitted_s or time.perf_counter()) - request.arrival_s) * 1e3, 1),
            "total_ms": round((time.perf_counter() - request.arrival_s) * 1e3, 1),
        }
        if error:
            fields["error"] = error
        if request.conversation_key:
            fields["conversation"] = request.conversation_key
        ttft = round((request.prefill_done_s - request.arrival_s) * 1e3, 1) if request.prefill_done_s else None
        self.history.add({**fields, "ttft_ms": ttft, "read_ms": round(read_ms, 1), "finished_at": time.time(),
                          "miss": self._misses.pop(request.request_id, None)})
        log.info(
            "prompt %d tokens = %d reused (device %d, host %d, disk %d) + %d read in %.0f ms (%.0f tok/s), "
            "%d generated, %d tools",
            request.prompt_len, reused, device, host, disk, computed, read_ms, rate, len(request.output_ids),
            request.num_tools,
            extra={"fields": fields},
        )
