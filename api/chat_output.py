"""The assistant's reply, parsed: engine text deltas in, content / reasoning / tool-call deltas out.

One ``ReplyAssembler`` per request wraps the model format's parser. Streaming uses ``feed`` / ``finish`` and
turns each result into a chat-completions delta; a whole response uses the same calls and joins them, so a
streamed reply and a whole one can never disagree.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from api.tool_calls import OutputParser, ParsedDelta
from api.tool_specs import CUSTOM_INPUT_ARGUMENT


@dataclass
class AssembledCall:
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class ReplyAssembler:
    """Parses the reply text of one request; keeps what a whole response needs."""

    parser: OutputParser
    reasoning_field: str | None = "reasoning_content"
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, AssembledCall] = field(default_factory=dict)
    leading_tokens: int = 0  # tokens fed before the answer (content or a call) began: the reasoning block

    def feed(self, text: str, tokens: int = 0) -> ParsedDelta:
        """Parse one engine delta; ``tokens`` (its token count) feeds ``reasoning_tokens``."""
        parsed = self._record(self.parser.feed(text) if text else ParsedDelta())
        if not (self.content or self.calls):
            self.leading_tokens += tokens
        return parsed

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the reasoning block, its tags included (0 when the reply had no reasoning): counted per
        delta, so a delta that both ends the reasoning and starts the answer is not counted."""
        return self.leading_tokens if self.reasoning else 0

    def finish(self) -> ParsedDelta:
        return self._record(self.parser.finish())

    def _record(self, parsed: ParsedDelta) -> ParsedDelta:
        if parsed.content:
            self.content.append(parsed.content)
        if parsed.reasoning:
            self.reasoning.append(parsed.reasoning)
        for delta in parsed.tool_calls:
            call = self.calls.setdefault(delta.index, AssembledCall(delta.index))
            call.id = delta.id or call.id
            call.name = delta.name or call.name
            call.arguments += delta.arguments
        return parsed

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls)

    def finish_reason(self, engine_reason: str) -> str:
        """The client's finish reason: "tool_calls" when the reply ended normally after calling tools (the
        engine's "abort" arrives as "stop": api/reply_stream.classify)."""
        return "tool_calls" if engine_reason == "stop" and self.calls else engine_reason

    def message(self) -> dict[str, Any]:
        """The whole assistant message in OpenAI's shape (content null when there is none; refusal null)."""
        text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None,
                                   "refusal": None}
        if self.reasoning and self.reasoning_field:
            message[self.reasoning_field] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in sorted(self.calls.values(), key=lambda c: c.index)
            ]
        return message

    def delta(self, parsed: ParsedDelta) -> dict[str, Any]:
        """A streamed chunk's ``delta`` for one parse result (empty dict when it carries nothing)."""
        out: dict[str, Any] = {}
        if parsed.content:
            out["content"] = parsed.content
        if parsed.reasoning and self.reasoning_field:
            out[self.reasoning_field] = parsed.reasoning
        if parsed.tool_calls:
            out["tool_calls"] = [_call_delta(d) for d in parsed.tool_calls]
        return out


def _call_delta(delta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    function: dict[str, Any] = {}
    if delta.name is not None:
        function["name"] = delta.name
    if delta.arguments or delta.name is not None:
        function["arguments"] = delta.arguments
    out["function"] = function
    return out


def custom_tool_input(arguments: str) -> str:
    """The freeform input of a custom tool call (its one argument), for dialects that report it as text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value.get(CUSTOM_INPUT_ARGUMENT, arguments) if isinstance(value, dict) else arguments
