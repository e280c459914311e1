"""One reply stream for every dialect: the engine's deltas as typed events, under one policy.

``reply_events`` turns a submitted request's delta stream into

    Started    the request took a slot (its cache reuse is known), or ADMISSION_WAIT_S passed without that
    Piece      a delta of the reply (text, token ids, logprobs)
    Keepalive  KEEPALIVE_S passed without another event (a long prefill on a CPU, a queue)
    Finished   the last delta: reason "stop" or "length"
    Failed     the engine failed, or its stream ended without a finish

and ends after Finished or Failed. The policies every dialect shares live here:
- keepalive: one interval; each dialect writes its own wire form (an SSE comment line for chat completions,
  Anthropic's ``ping``, the Responses ``keepalive`` event). None is sent before Started, so a dialect that
  opens on Started (Messages' ``message_start``) never sends one first.
- abort: the engine ends a request with "abort" only when the server stops (a client that goes away never
  reads its stream again). That is Finished with reason "stop" and ``interrupted`` set: chat completions and
  Messages end the reply normally, as clients expect; Responses says ``response.failed`` so Codex retries.
- disconnect: closing the iterator (a streaming client went away) aborts the engine request; a whole reply
  is read by ``collect_or_disconnect``, which aborts it and returns None when the client goes away first.
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator, Union

from starlette.requests import Request as HTTPRequest

from api.errors import internal_error
from scheduler.request import Delta, Request

KEEPALIVE_S = 5.0  # read at each wait, so a test can shorten it
ADMISSION_WAIT_S = 10.0  # how long Started waits to learn the cache reuse (known once a slot takes it)


@dataclass(frozen=True)
class Started:
    """The request took a slot (or the admission wait ran out): ``cached_tokens`` of the prompt are reused."""

    cached_tokens: int


@dataclass(frozen=True)
class Piece:
    """A delta of the reply that is not its last."""

    delta: Delta


@dataclass(frozen=True)
class Keepalive:
    """Nothing else happened for KEEPALIVE_S."""


@dataclass(frozen=True)
class Finished:
    """The reply's last delta; ``reason`` is "stop" or "length" (the delta's own reason mapped so)."""

    delta: Delta
    interrupted: bool = False  # the server stopped it (shutdown): ended as "stop", but not by the model

    @property
    def reason(self) -> str:
        return self.delta.finish_reason


@dataclass(frozen=True)
class Failed:
    """The engine failed (or its stream ended without a finish); ``delta`` is its last, reason "error"."""

    delta: Delta

    @property
    def message(self) -> str:
        return self.delta.error or "generation failed"


ReplyEvent = Union[Started, Piece, Keepalive, Finished, Failed]


def classify(delta: Delta) -> Piece | Finished | Failed:
    """The event one engine delta is: the one abort and error mapping every dialect shares."""
    if delta.finish_reason is None:
        return Piece(delta)
    if delta.finish_reason == "error":
        return Failed(delta)
    if delta.finish_reason == "abort":
        return Finished(dataclasses.replace(delta, finish_reason="stop"), interrupted=True)
    return Finished(delta)


async def reply_events(request: Request, stream: AsyncIterator[Delta]) -> AsyncIterator[ReplyEvent]:
    """The typed events of one submitted request (see the module docstring). Closing the iterator before
    its end aborts the request."""
    pending: asyncio.Future | None = None
    admitted = asyncio.ensure_future(request.admitted.wait())
    try:
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.wait({pending, admitted}, timeout=ADMISSION_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        yield Started(request.cached_tokens)
        while True:
            while not (await asyncio.wait({pending}, timeout=KEEPALIVE_S))[0]:
                yield Keepalive()
            try:
                event = classify(pending.result())
            except StopAsyncIteration:  # the engine always ends with a finish delta; never hang if not
                event = Failed(Delta(finish_reason="error", error="the reply ended without a finish"))
            pending = None
            yield event
            if not isinstance(event, Piece):
                return
            pending = asyncio.ensure_future(anext(stream))
    finally:
        for task in (pending, admitted):
            if task is not None and not task.done():  # the client went away while we waited
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()  # aborts the request when it has not finished


async def collect_or_disconnect(http_request: HTTPRequest,
                                events: AsyncIterator[ReplyEvent]) -> list[ReplyEvent] | None:
    """Every event of a whole reply but the keepalives, or None when the client went away first (the
    request is then aborted)."""
    async def collect() -> list[ReplyEvent]:
        return [event async for event in events if not isinstance(event, Keepalive)]

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(wait_for_disconnect(http_request))
    done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if collector not in done:  # the client went away: stop computing for it
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        await events.aclose()
        return None
    watcher.cancel()
    return collector.result()


@dataclass(frozen=True)
class WholeReply:
    """A collected reply that finished: its deltas (the last one Finished's) and how it ended."""

    deltas: list[Delta]
    finished: Finished

    @property
    def text(self) -> str:
        return "".join(delta.text for delta in self.deltas)

    @property
    def logprobs(self) -> list:
        return [lp for delta in self.deltas for lp in delta.logprobs]


def whole_reply(events: list[ReplyEvent]) -> WholeReply:
    """The collected events as one reply; a reply that Failed is a 500 with the engine's message."""
    last = events[-1]
    if isinstance(last, Failed):
        raise internal_error(last.message)
    assert isinstance(last, Finished), last
    return WholeReply([event.delta for event in events if isinstance(event, (Piece, Finished))], last)


async def wait_for_disconnect(http_request: HTTPRequest) -> None:
    """Returns once the client has closed the connection."""
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return
