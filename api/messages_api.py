"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API, as Claude Code speaks it.

The body becomes a ``ChatTurn`` (api/messages_schema.py) and runs as one engine request through
``start_chat_turn``, like a chat completion; only the output is Anthropic's (api/messages_events.py).
A stream goes ``message_start``, ``ping``, the content blocks, ``message_delta`` (stop_reason, usage),
``message_stop``; a ``ping`` follows every few seconds in which nothing else was sent (a long prefill), and a
failure after the stream began is an ``error`` event. Errors before it are Anthropic-shaped JSON (the
``endpoint`` decorator renders them with ``anthropic_error_response``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable, Mapping

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from api.chat_turn import ChatTurn, encode_turn, render_turn
from api.errors import APIError, internal_error
from api.messages_events import BlockWriter, message_shell, sse_event, stop_reason, usage_body
from api.messages_schema import CountTokensRequest, MessagesRequest, chat_turn
from api.sampling_defaults import SamplingDefaults
from api.schemas import parse_body
from api.tenancy import api_keys, cache_salt_for
from api.tool_specs import normalise_tools
from api.turn_runner import TurnRun, collect_or_disconnect, start_chat_turn
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from scheduler.request import Delta

log = logging.getLogger("strata.api")
PING_INTERVAL_S = 5.0  # a ping after this long without another event keeps idle-timeouts quiet during prefill
ADMISSION_WAIT_S = 10.0  # how long message_start waits to learn the cache reuse (known once a slot takes it)
PING = sse_event("ping", {"type": "ping"})
SESSION_HEADER = "x-claude-code-session-id"  # Claude Code >= 2.1.86 sends one per session
_mapped_models: set[str] = set()
_system_turns: dict[str, bool] = {}  # chat template source -> whether it renders a system turn mid-conversation


def _check_model(state, name: str) -> None:
    """Claude Code asks for its own names (claude-sonnet-*, a haiku for background work): any name this
    server does not serve is answered by the served model, logged once per name."""
    if name not in state.model_aliases and name not in _mapped_models:
        _mapped_models.add(name)
        log.info("model %r is not served here; %s answers for it", name, state.served_name)


def _takes_system_turns(state) -> bool:
    """Whether the chat template renders a system turn after the first user turn (checked once per
    template on a tiny conversation): Gemma's refuses one, ChatML, Qwen and Llama 3 render it."""
    template = state.loaded.chat_template.template  # its source: the key stays right for a reloaded template
    if template not in _system_turns:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"},
                 {"role": "user", "content": "u"}]
        try:
            render_turn(state, ChatTurn(probe, normalise_tools(None)))
            _system_turns[template] = True
        except APIError:
            _system_turns[template] = False
            log.info("the chat template renders no system turn after the first user turn; a system message "
                     "inside a Messages conversation joins the user turn before it")
    return _system_turns[template]


def _turn(state, body, headers) -> ChatTurn:
    """The body's ChatTurn, named by Claude Code's session, system turns as the template takes them."""
    return chat_turn(body, conversation_key(headers, body.metadata), system_turns=_takes_system_turns(state))


def conversation_key(headers: Mapping[str, str], metadata: dict[str, Any] | None) -> str | None:
    """Claude Code's session id: its header, else the session_id inside metadata.user_id (a JSON object in
    2.1.x, ``user_<hash>_account_<id>_session_<uuid>`` before)."""
    if headers.get(SESSION_HEADER):
        return headers[SESSION_HEADER]
    user_id = (metadata or {}).get("user_id")
    if not isinstance(user_id, str):
        return None
    if user_id.startswith("{"):
        try:
            session = json.loads(user_id).get("session_id")
        except (ValueError, AttributeError):
            return None
        return session if isinstance(session, str) and session else None
    _, found, session = user_id.rpartition("_session_")
    return session if found and session else None


def _tenant_salt(state, headers: Mapping[str, str]) -> str | None:
    # With several --api-key tenants the cache salt comes from the Bearer header (api/tenancy.py); a client
    # that sends only x-api-key gets a salt from that key instead, so tenants still never share cached KV.
    key = headers.get("x-api-key")
    if key and len(api_keys(state.config)) > 1 and not headers.get("authorization"):
        return f"x-api-key:{key}"
    return None


async def count_tokens(state, http_request: HTTPRequest, request_id: str, raw: bytes) -> Response:
    """{"input_tokens": N}: the prompt the same body would render to, tokenized."""
    body = parse_body(CountTokensRequest, raw)
    _check_model(state, body.model)
    turn = _turn(state, body, http_request.headers)
    salt = cache_salt_for(state.config, http_request.headers.get("authorization", ""),
                          _tenant_salt(state, http_request.headers))
    # as the prompt would be: the replies this server generated kept as their ids (api/prompt_ids.py)
    return JSONResponse({"input_tokens": len(encode_turn(state, turn, render_turn(state, turn), salt).ids)})


def sampling_for(body: MessagesRequest, defaults: SamplingDefaults,
                 default_seed: int | None) -> Callable[[int], SamplingParams]:
    """max_tokens -> the request's sampling; what the body leaves out takes the model's ``defaults``."""
    def make(max_tokens: int) -> SamplingParams:
        return defaults.params(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                               top_p=body.top_p, seed=default_seed, stop=tuple(body.stop_sequences or ()))
    return make


async def create_message(state, http_request: HTTPRequest, request_id: str, raw: bytes) -> Response:
    """One Messages request: a stream of Anthropic's events, or the whole message object."""
    body = parse_body(MessagesRequest, raw)
    _check_model(state, body.model)
    stops = tuple(body.stop_sequences or ())
    # max_tokens 0 pre-warms the cache: the prompt is read and the one token sampled after it is dropped.
    run = start_chat_turn(state, http_request, request_id, _turn(state, body, http_request.headers),
                          requested_max_tokens=max(1, body.max_tokens),
                          make_params=sampling_for(body, state.sampling_defaults, state.config.seed),
                          client_salt=_tenant_salt(state, http_request.headers), num_tools=len(body.tools or []),
                          top_logprobs=0 if stops else None)  # see StopTracker
    message_id = "msg_" + request_id.removeprefix("req-")
    tracker = StopTracker(stops, state.loaded.tokenizer)
    if body.stream:
        events = _stream_events(run, BlockWriter(keeps=body.max_tokens > 0), tracker, message_id, body.model)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outcome = await collect_or_disconnect(http_request, tracker.watch(run.stream))
    if outcome is None:
        return Response(status_code=499)
    text, _, last = outcome
    if last.finish_reason == "error":
        raise internal_error(last.error or "generation failed")
    writer = BlockWriter(keeps=body.max_tokens > 0)
    writer.feed(run.assembler.feed(text))
    writer.feed(run.assembler.finish())
    writer.close()
    stop_sequence = tracker.matched(last)
    usage = usage_body(last.usage, generated=writer.keeps)
    reason = stop_reason(last.finish_reason, writer.has_tool_calls, stop_sequence)
    return JSONResponse(message_shell(message_id, body.model, writer.blocks, usage, reason, stop_sequence))


class StopTracker:
    """Which stop sequence ended a reply. The engine reports only "stop"; its text stream ends where the
    sequence began, so the sequence is the one the generated tokens spell from there. Every token must then
    arrive in a delta, and the one that completes a sequence carries no text when none precedes the
    sequence in it: asking for logprobs (top 0, a log-softmax per token) makes the engine send it anyway."""

    def __init__(self, stops: tuple[str, ...], tokenizer: Tokenizer):
        self.stops, self.tokenizer = tuple(s for s in stops if s), tokenizer
        self.text: list[str] = []
        self.ids: list[int] = []

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.ids += delta.token_ids

    async def watch(self, stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        try:
            async for delta in stream:
                self.add(delta)
                yield delta
        finally:
            await stream.aclose()

    def matched(self, last: Delta) -> str | None:
        if last.finish_reason != "stop" or not self.stops:
            return None
        emitted = "".join(self.text)
        raw = b"".join(self.tokenizer.token_piece(i) for i in self.ids).decode("utf-8", errors="replace")
        tail = raw[len(emitted):]
        return next((stop for stop in self.stops if tail.startswith(stop)), None)


async def _wait_for_admission(run: TurnRun) -> None:
    request, waited = run.request, 0.0
    while request.admitted_s is None and not request.is_finished and request.outbox.empty():
        if waited >= ADMISSION_WAIT_S:
            return
        await asyncio.sleep(0.01)
        waited += 0.01


async def _stream_events(run: TurnRun, writer: BlockWriter, tracker: StopTracker, message_id: str,
                         model: str) -> AsyncIterator[bytes]:
    stream, pending = run.stream, None
    try:
        await _wait_for_admission(run)
        usage = usage_body(None, len(run.prepared.prompt_ids), run.request.cached_tokens)
        yield sse_event("message_start", {"type": "message_start",
                                          "message": message_shell(message_id, model, [], usage)})
        yield PING
        while True:
            pending = asyncio.ensure_future(anext(stream))
            while not (await asyncio.wait({pending}, timeout=PING_INTERVAL_S))[0]:
                yield PING
            try:
                delta = pending.result()
            except StopAsyncIteration:  # the engine always ends with a finish delta; never hang if not
                delta = Delta(finish_reason="error", error="the reply ended without a finish")
            pending = None
            if delta.finish_reason == "error":
                yield _error_event(delta.error or "generation failed")
                return
            tracker.add(delta)
            events = writer.feed(run.assembler.feed(delta.text))
            if delta.finish_reason is not None:
                events += writer.feed(run.assembler.finish()) + writer.close()
            for name, data in events:
                yield sse_event(name, data)
            if delta.finish_reason is not None:
                stop_sequence = tracker.matched(delta)
                reason = stop_reason(delta.finish_reason, writer.has_tool_calls, stop_sequence)
                yield sse_event("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                                  "usage": usage_body(delta.usage, generated=writer.keeps)})
                yield sse_event("message_stop", {"type": "message_stop"})
                return
    except Exception:  # a bug: the client still gets Anthropic's error event, the log the traceback
        log.exception("the Messages stream failed")
        yield _error_event("internal server error")
    finally:
        if pending is not None:  # the client went away while we waited for a token
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()  # closing the stream aborts the request


def _error_event(message: str) -> bytes:
    return sse_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})
