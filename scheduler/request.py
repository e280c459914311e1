"""A generation request as the scheduler tracks it, and the deltas it streams back to the API."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from engine.sampling import Sampler, SamplingParams
from engine.sequence import Sequence
from scheduler.cache.plans import Allocation

if TYPE_CHECKING:
    from engine.grammar import TokenConstraint


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class Delta:
    """One piece of a request's output. The last delta has finish_reason set and carries the usage."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    usage: "Usage | None" = None
    error: str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Request:
    """Everything the scheduler knows about one request. Mutated only on the event loop, except
    `sampler`, `seq.num_computed` and `pending_samples`, which the compute worker touches during a step
    while the loop waits for it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs: int | None = None  # None: no logprobs; 0..20: how many alternatives per token
    arrival_s: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    sampler: Sampler | None = None
    output_ids: list[int] = field(default_factory=list)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    is_cancelled: bool = False
    is_finished: bool = False
    slot_id: int | None = None
    group: int = 0  # the batch group (a row map of slots) whose steps carry this request
    admitted_s: float | None = None
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # set with admitted_s (api/reply_stream.py)
    prefill_done_s: float | None = None
    last_progress_s: float | None = None
    cached_tokens: int = 0
    allocation: "Allocation | None" = None
    cache_salt: str = ""  # requests with different salts never share cached blocks
    describe_position: Callable[[int], str] | None = None  # token position -> "message 3 (user)" for logs
    constraint: "TokenConstraint | None" = None  # grammar on the sampled tokens (engine/grammar.py)
    num_tools: int = 0  # tool definitions the request carried, for the summary log line
    conversation_key: str | None = None  # the client's name for the conversation (prompt_cache_key, session id)
    earlier_turns: int = 0  # assistant replies the prompt carries (0: the conversation's first turn)
    preemptions: int = 0  # times its blocks were given back to the cache for a request that needed room
    checkpoint_positions: tuple[int, ...] = ()  # hybrid models: where messages begin, worth a state checkpoint
    # hybrid models: where a branch is likelier than elsewhere (a few tokens into a message's content): states
    # taken there rank with the periodic ones, given up before the branch points above (api/branch_hints.py)
    checkpoint_guesses: tuple[int, ...] = ()
    line_starts: tuple[int, ...] = ()  # hybrid models: where lines begin; periodic checkpoints move back to one

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.seq is not None and self.seq.num_computed < self.prompt_len

    def usage(self) -> Usage:
        return Usage(self.prompt_len, len(self.output_ids), self.cached_tokens)
