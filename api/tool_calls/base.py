"""The shapes every tool-call format shares: streamed deltas, the parser protocol, the format base class.

A parser turns decoded model output, fed in arbitrary pieces, into ``ParsedDelta``s: visible content,
reasoning text, and tool-call fragments shaped like OpenAI's streamed ``delta.tool_calls``. A ``ToolFormat``
bundles one model family's parser, its llguidance grammar for forced calls, and (for "generic" only) the
system prompt that teaches the model the answer format.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

_CALL_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_CALL_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCallDelta:
    """One fragment of one tool call, as in OpenAI's streamed ``delta.tool_calls[i]``."""

    index: int  # 0, 1, ... per call in this reply
    id: str | None = None  # only on the first delta of a call
    name: str | None = None  # only on the first delta of a call; a call is never emitted before its name
    arguments: str = ""  # the fragments of one call joined = its full arguments JSON text


@dataclass
class ParsedDelta:
    """What one ``feed``/``finish`` produced: content, reasoning, and tool-call fragments."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to send."""
        return not self.content and not self.reasoning and not self.tool_calls

    def extend(self, other: "ParsedDelta") -> None:
        """Append ``other`` to this delta, merging argument fragments of the same call."""
        self.content += other.content
        self.reasoning += other.reasoning
        for call in other.tool_calls:
            self.add_call_delta(call)

    def add_call_delta(self, call: ToolCallDelta) -> None:
        """Append one call fragment; a header-less fragment of the last call is merged into it."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == call.index and call.id is None and call.name is None:
            last.arguments += call.arguments
        else:
            self.tool_calls.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))


class OutputParser(Protocol):
    """Streaming parser of one reply. Feed decoded text in any split (even 1 char), then call finish()."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    @property
    def num_tool_calls(self) -> int: ...


class PlainContentParser:
    """The parser for replies without tools: everything is content."""

    def __init__(self) -> None:
        self.num_tool_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


def function_specs(tools: list[dict] | None) -> list[dict]:
    """The ``function`` objects of the OpenAI-shape tools (other tool types are skipped: no format can call them)."""
    specs = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") == "function" and isinstance(function, dict) and function.get("name"):
            specs.append(function)
    return specs


def parameters_schema(function: Mapping[str, Any]) -> dict:
    """A function's parameters schema; a missing or empty one means "any object"."""
    schema = function.get("parameters")
    return dict(schema) if isinstance(schema, dict) and schema else {"type": "object"}


@dataclass(frozen=True)
class ReasoningTags:
    """The markers around reasoning ("thinking") text in a reply."""

    start: str = "<think>"
    end: str = "</think>"


class ToolFormat:
    """One model family's tool-call format. Subclasses fill in the class attributes and the methods.

    ``renders_in_template``: the chat template writes the tools into the prompt (False only for "generic").
    ``lazy_trigger``: text after which a tool call has begun; the lazy grammar of tool_choice "auto" describes
    the text right after it. None means constrained from the first token (generic).
    ``trigger_only_at_start``: the trigger counts only at the start of the reply (after whitespace), as for
    Llama 3's bare-JSON calls, where the same text mid-reply is ordinary content.
    ``owns_reasoning``: the format's own markup carries the reasoning (harmony's analysis channel), so its
    parser runs on every reply, tools or not, and no reasoning-tag splitter wraps it.
    ``recovers_json_calls``: models of this format also write calls as bare or fenced JSON objects, outside the
    markup; with tool_choice auto such calls are recovered (api/tool_calls/recovery.py). False where JSON is
    the format itself (llama3_json, generic) or the markup is a whole protocol (harmony).
    ``markers``: the texts of the format's markup. Where one is a control token of the vocabulary its text stays in
    the reply for the parser; every other control token the model writes is left out of the text, as llama-server
    does (api/chat_protocol.py).
    """

    name: str = ""
    renders_in_template: bool = True
    parallel_by_default: bool = True  # when a request does not set parallel_tool_calls (OpenAI's default)
    lazy_trigger: str | None = None
    trigger_only_at_start: bool = False
    owns_reasoning: bool = False  # the parser splits reasoning itself and parses replies without tools too
    recovers_json_calls: bool = False
    markers: tuple[str, ...] = ()

    def create_parser(self, tools: list[dict]) -> OutputParser:
        """A fresh streaming parser for one reply; ``tools`` are OpenAI-shape tool definitions."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], *, required: bool, forced_name: str | None, allow_parallel: bool,
                special_token_ids: Mapping[str, int] | None = None) -> str:
        """An llguidance Lark grammar for the reply (see the package docstring for required/lazy).

        ``special_token_ids`` maps a marker (e.g. ``"[TOOL_CALLS]"``) to its token id when the tokenizer has it
        as a special token: llguidance matches special tokens only as ``<[id]>``, never as their text.
        """
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str | None:
        """Text the server adds to the system prompt; None for formats whose template renders the tools."""
        return None

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"
