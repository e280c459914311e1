"""Anthropic Messages API output: content blocks, their SSE events, usage, errors.

``BlockWriter`` turns the reply parser's deltas (api/chat_output.py) into content blocks: reasoning into
``thinking``, content into ``text``, each tool call into ``tool_use``. Streaming sends the events it returns
(``content_block_start`` / ``_delta`` / ``_stop``); a whole message takes ``blocks`` after the same calls,
so a streamed reply and a whole one can never disagree.

Usage follows Anthropic's convention: ``input_tokens`` are the prompt tokens read anew, the ones reused from
the conversation cache are ``cache_read_input_tokens`` (their sum is the whole prompt), and
``cache_creation_input_tokens`` is 0: every computed token is cached here without being billed twice.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

from starlette.responses import JSONResponse, Response

from api.errors import APIError
from api.tool_calls import ParsedDelta, ToolCallDelta
from scheduler.request import Usage

log = logging.getLogger("strata.api")
Event = tuple[str, dict[str, Any]]

# Anthropic's error type per HTTP status; our 503 (queue full, shutting down) is Anthropic's 529.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                529: "overloaded_error"}
# api.errors.context_overflow's wording, read back for Claude Code's "prompt is too long" form
_OVERFLOW = re.compile(r"maximum context length is (?P<limit>\d+) tokens.*?\((?P<prompt>\d+) in the prompt")


def usage_body(usage: Usage | None, prompt_tokens: int = 0, cached_tokens: int = 0,
               generated: bool = True) -> dict[str, int]:
    """Anthropic's usage object: input_tokens excludes the cache reads (see the module docstring).
    Without ``usage`` (message_start), the prompt's size and reuse as known so far; ``generated`` False: a
    max_tokens 0 request, whose one sampled token is not the client's."""
    prompt = usage.prompt_tokens if usage else prompt_tokens
    cached = usage.cached_tokens if usage else cached_tokens
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": usage.completion_tokens if usage and generated else 0}


def message_shell(message_id: str, model: str, content: list[dict[str, Any]], usage: dict[str, int],
                  stop_reason: str | None = None, stop_sequence: str | None = None) -> dict[str, Any]:
    """The message object (message_start's with no content and stop_reason null; the whole reply's)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def stop_reason(engine_reason: str, has_tool_calls: bool, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason for the finish reason ("stop" or "length"; api/reply_stream.py makes the
    engine's "abort" a "stop")."""
    if engine_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if has_tool_calls else "end_turn"


def thinking_signature(thinking: str) -> str:
    """A stand-in for Anthropic's opaque signature: clients store it and send it back; nothing checks it."""
    return "strata-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


class BlockWriter:
    """Content blocks of one reply, built from parsed deltas; each call returns the events to stream."""

    def __init__(self, keeps: bool = True) -> None:
        self.keeps = keeps  # False: max_tokens 0, the reply is dropped (the prompt was only read for the cache)
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the last block while it is still open
        self._arguments: dict[int, str] = {}  # block index -> the tool call's JSON text so far
        self._call_blocks: dict[int, int] = {}  # tool call index -> block index

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._call_blocks)

    def feed(self, parsed: ParsedDelta) -> list[Event]:
        events: list[Event] = []
        if not self.keeps:
            return events
        if parsed.reasoning:
            events += self._text_like("thinking", parsed.reasoning)
        if parsed.content:
            events += self._text_like("text", parsed.content)
        for call in parsed.tool_calls:
            events += self._call(call)
        return events

    def close(self) -> list[Event]:
        """Close the last block (a thinking block gets its signature first); the tool inputs are set."""
        if self._open is None:
            return []
        index = len(self.blocks) - 1
        block, events = self.blocks[index], []
        if self._open == "thinking":
            block["signature"] = thinking_signature(block["thinking"])
            events.append(_delta(index, {"type": "signature_delta", "signature": block["signature"]}))
        elif self._open == "tool_use":
            block["input"] = _tool_input(self._arguments.get(index, ""), block["name"])
        self._open = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _start(self, kind: str, block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.blocks.append(block)
        self._open = kind
        shown = dict(block, input={}) if kind == "tool_use" else dict(block)  # the input arrives as deltas
        if kind == "thinking":
            shown["signature"] = ""
        events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                               "content_block": shown}))
        return events

    def _text_like(self, kind: str, text: str) -> list[Event]:
        events = [] if self._open == kind else self._start(kind, {"type": kind, kind: ""})
        index = len(self.blocks) - 1
        self.blocks[index][kind] += text
        return events + [_delta(index, {"type": f"{kind}_delta", kind: text})]

    def _call(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if call.index not in self._call_blocks:
            call_id = "toolu_" + (call.id or "").removeprefix("call_")  # Anthropic's id look
            events = self._start("tool_use", {"type": "tool_use", "id": call_id, "name": call.name or ""})
            self._call_blocks[call.index] = len(self.blocks) - 1
        index = self._call_blocks[call.index]
        if call.arguments:
            self._arguments[index] = self._arguments.get(index, "") + call.arguments
            events.append(_delta(index, {"type": "input_json_delta", "partial_json": call.arguments}))
        return events


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _tool_input(arguments: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:  # a call cut off by max_tokens
        log.info("tool call %r ended before its arguments were complete JSON; its input is {}", name)
        return {}
    return value if isinstance(value, dict) else {}


def anthropic_error_body(exc: APIError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    status = 529 if exc.status == 503 else exc.status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": _message(exc)}}


def anthropic_error_response(exc: APIError) -> Response:
    """The JSON response for an APIError on a Messages route (the endpoint decorator's error renderer)."""
    status, body = anthropic_error_body(exc)
    return JSONResponse(body, status_code=status, headers=exc.headers)


def _message(exc: APIError) -> str:
    # Claude Code recognises an overlong prompt by "prompt is too long: N tokens > M maximum" (and then
    # compacts the conversation); our own message follows, with the flag that raises the limit.
    if exc.status == 401:
        return "Missing or invalid API key; send it as 'x-api-key: <key>' or 'Authorization: Bearer <key>'"
    found = _OVERFLOW.search(exc.message) if exc.code == "context_length_exceeded" else None
    if found:
        return f"prompt is too long: {found['prompt']} tokens > {found['limit']} maximum. {exc.message}"
    return exc.message
