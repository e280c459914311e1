"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API, as Claude Code speaks it.

The body becomes a ``ChatTurn`` (api/messages_schema.py) and runs as one engine request through
``start_chat_turn``, like a chat completion; only the output is Anthropic's (api/messages_events.py).
A stream goes ``message_start``, ``ping``, the content blocks, ``message_delta`` (stop_reason, usage),
``message_stop``; a ``ping`` follows every few seconds in which nothing else was sent (a long prefill), and a
failure after the stream began is an ``error`` event. Errors before it are Anthropic-shaped JSON (the
``endpoint`` decorator renders them with ``anthropic_error_response``).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from api.chat_turn import ChatTurn, encode_turn, render_turn
from api.errors import APIError
from api.messages_events import BlockWriter, message_shell, stop_reason, usage_body
from api.messages_schema import CountTokensRequest, MessagesRequest, chat_turn
from api.reply_stream import (Failed, Keepalive, Piece, ReplyEvent, Started, collect_or_disconnect,
                              whole_reply)
from api.sampling_defaults import sampling_for
from api.schemas import parse_body
from api.sse import encode_stream, sse_frame, sse_response
from api.tenancy import api_keys, cache_salt_for
from api.tool_specs import normalise_tools
from api.turn_runner import TurnRun, served_model, start_chat_turn
from engine.tokenizer import Tokenizer
from scheduler.request import Delta

log = logging.getLogger("strata.api")
PING = sse_frame({"type": "ping"}, "ping")  # Anthropic's keepalive (api/reply_stream.py sets the interval)
SESSION_HEADER = "x-claude-code-session-id"  # Claude Code >= 2.1.86 sends one per session
_system_turns: dict[str, bool] = {}  # chat template source -> whether it renders a system turn mid-conversation


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
    served_model(state, body.model, any_name=True)  # Claude Code's names: answered by the served model
    turn = _turn(state, body, http_request.headers)
    salt = cache_salt_for(state.config, http_request.headers.get("authorization", ""),
                          _tenant_salt(state, http_request.headers))
    # as the prompt would be: the replies this server generated kept as their ids (api/prompt_ids.py)
    return JSONResponse({"input_tokens": len(encode_turn(state, turn, render_turn(state, turn), salt).ids)})


async def create_message(state, http_request: HTTPRequest, request_id: str, raw: bytes) -> Response:
    """One Messages request: a stream of Anthropic's events, or the whole message object."""
    body = parse_body(MessagesRequest, raw)
    served_model(state, body.model, any_name=True)  # Claude Code's names: answered by the served model
    stops = tuple(body.stop_sequences or ())
    # max_tokens 0 pre-warms the cache: the prompt is read and the one token sampled after it is dropped.
    run = start_chat_turn(state, http_request, request_id, _turn(state, body, http_request.headers),
                          requested_max_tokens=max(1, body.max_tokens),
                          make_params=sampling_for(body.requested_sampling(), state.sampling_defaults,
                                                   state.config.seed),
                          client_salt=_tenant_salt(state, http_request.headers), num_tools=len(body.tools or []),
                          top_logprobs=0 if stops else None)  # see StopTracker
    message_id = "msg_" + request_id.removeprefix("req-")
    tracker = StopTracker(stops, state.loaded.tokenizer)
    writer = BlockWriter(keeps=body.max_tokens > 0)
    if body.stream:
        encoder = MessagesStreamEncoder(run, writer, tracker, message_id, body.model)
        return sse_response(encode_stream(run.events, encoder.encode, encoder.on_bug))
    collected = await collect_or_disconnect(http_request, run.events)
    if collected is None:
        return Response(status_code=499)
    reply = whole_reply(collected)
    for delta in reply.deltas:
        tracker.add(delta)
    writer.feed(run.assembler.feed(reply.text))
    writer.feed(run.assembler.finish())
    writer.close()
    stop_sequence = tracker.matched(reply.finished.delta)
    usage = usage_body(reply.finished.delta.usage, generated=writer.keeps)
    reason = stop_reason(reply.finished.reason, writer.has_tool_calls, stop_sequence)
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

    def matched(self, last: Delta) -> str | None:
        if last.finish_reason != "stop" or not self.stops:
            return None
        emitted = "".join(self.text)
        raw = b"".join(self.tokenizer.token_piece(i) for i in self.ids).decode("utf-8", errors="replace")
        tail = raw[len(emitted):]
        return next((stop for stop in self.stops if tail.startswith(stop)), None)


class MessagesStreamEncoder:
    """Anthropic's events for a reply's events: ``message_start`` once the request took a slot (its usage
    then says what the cache reused) and a ``ping``, the content blocks, ``message_delta`` and
    ``message_stop``; a ``ping`` for each keepalive; a failure is an ``error`` event."""

    def __init__(self, run: TurnRun, writer: BlockWriter, tracker: StopTracker, message_id: str, model: str):
        self.run, self.writer, self.tracker = run, writer, tracker
        self.message_id, self.model = message_id, model

    def encode(self, event: ReplyEvent) -> list[bytes]:
        """The frames of one event (mutates the writer, the tracker and the run's assembler)."""
        if isinstance(event, Started):
            usage = usage_body(None, len(self.run.prepared.prompt_ids), event.cached_tokens)
            start = {"type": "message_start", "message": message_shell(self.message_id, self.model, [], usage)}
            return [sse_frame(start, "message_start"), PING]
        if isinstance(event, Keepalive):
            return [PING]
        if isinstance(event, Failed):
            return [_error_event(event.message)]
        writer, assembler, delta = self.writer, self.run.assembler, event.delta
        self.tracker.add(delta)
        events = writer.feed(assembler.feed(delta.text))
        if isinstance(event, Piece):
            return [sse_frame(data, name) for name, data in events]
        events += writer.feed(assembler.finish()) + writer.close()
        stop_sequence = self.tracker.matched(delta)
        reason = stop_reason(event.reason, writer.has_tool_calls, stop_sequence)
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                         "usage": usage_body(delta.usage, generated=writer.keeps)}))
        events.append(("message_stop", {"type": "message_stop"}))
        return [sse_frame(data, name) for name, data in events]

    @staticmethod
    def on_bug() -> list[bytes]:  # the client still gets Anthropic's error event, the log the traceback
        return [_error_event("internal server error")]


def _error_event(message: str) -> bytes:
    return sse_frame({"type": "error", "error": {"type": "api_error", "message": message}}, "error")
