"""gpt-oss's harmony format: every reply is a run of channel messages, reasoning and tool calls included.

    <|channel|>analysis<|message|>Let me check the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message is ``header <|message|> body terminator``; the header names the channel and, for a tool call, the
recipient (`` to=functions.NAME``, before or after ``<|channel|>``) and the argument type (``<|constrain|>json``
or `` json``); the terminator is ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last two end generation).
Mapped onto the chat-completions layer as OpenAI's harmony guide says:

    analysis                      -> reasoning
    final, commentary (no "to=")  -> content (commentary without a recipient is a user-visible preamble)
    any channel with to=NAME      -> a tool call NAME ("functions." dropped), the body as its arguments

Bodies stream as they arrive; only text that may be the start of a marker is held back. Output that does
not begin with harmony markup (a model ignoring the format) is all content. The parser owns the reasoning
split (``owns_reasoning``), so it runs on every reply, with or without tools.
"""
from __future__ import annotations

import re
from typing import Mapping

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import OutputParser, ParsedDelta, ToolCallDelta, ToolFormat, new_call_id
from api.tool_calls.stream_base import ToolCallStreamParser, find_first_marker, partial_marker_length

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN, START)  # a missing <|end|> before the next <|start|> still ends the body
_HEADER_OPENERS = (START, CHANNEL, "to=")  # after leading whitespace: " to=" right after the prompt's role
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_WHITESPACE = " \t\n\r"


class HarmonyParser(ToolCallStreamParser):
    """States: "header" (up to <|message|>) -> "body" (up to a terminator) -> "header" ...; or "plain".
    feed / finish / num_tool_calls come from the shared stream parser; only the states are harmony's."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "header"
        self._target = "content"  # where the current body goes: "content", "reasoning" or "call"

    def _finish_open(self) -> None:
        if self._state == "header" and self._pending.strip(_WHITESPACE):
            self._out.content += self._pending  # a header cut off by the end of generation: not lost
        self._pending = ""

    def _step(self, final: bool) -> bool:
        if self._state == "plain":
            self._out.content += self._pending
            self._pending = ""
            return False
        if self._state == "header":
            return self._header(final)
        return self._body(final)

    def _header(self, final: bool) -> bool:
        body = self._pending.lstrip(_WHITESPACE)
        if not body:
            return False
        if not body.startswith(_HEADER_OPENERS):
            if not final and any(opener.startswith(body) for opener in _HEADER_OPENERS):
                return False  # an opener still arriving
            self._state = "plain"  # not harmony: everything is content
            return True
        position = body.find(MESSAGE)
        if position < 0:
            return False  # the header is still arriving (at the end: released by finish)
        self._open_message(body[:position])
        self._pending, self._state = body[position + len(MESSAGE):], "body"
        return True

    def _open_message(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient is not None:
            name = recipient.group(1)
            name = name[len("functions."):] if name.startswith("functions.") else name
            self._out.add_call_delta(ToolCallDelta(self._num_calls, new_call_id(), name))
            self._num_calls += 1
            self._target = "call"
        else:
            self._target = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _body(self, final: bool) -> bool:
        position, marker = find_first_marker(self._pending, TERMINATORS)
        if marker is not None:
            self._emit(self._pending[:position])
            rest = self._pending[position + len(marker):]
            self._pending = marker + rest if marker == START else rest  # <|start|> opens the next header
            self._state = "header"
            return True
        hold = 0 if final else partial_marker_length(self._pending, TERMINATORS)
        self._emit(self._pending[:len(self._pending) - hold])
        self._pending = self._pending[len(self._pending) - hold:]
        return False

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._target == "call":
            self._out.add_call_delta(ToolCallDelta(self._num_calls - 1, arguments=text))
        elif self._target == "reasoning":
            self._out.reasoning += text
        else:
            self._out.content += text


class HarmonyFormat(ToolFormat):
    """gpt-oss's channels: reasoning, content and ``to=functions.NAME`` calls (see the module docstring)."""

    name = "harmony"
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
    lazy_trigger = " to=functions."
    owns_reasoning = True  # the parser splits reasoning itself and runs on replies without tools too

    def create_parser(self, tools: list[dict]) -> OutputParser:
        return HarmonyParser()

    def grammar(self, tools: list[dict], *, required: bool, forced_name: str | None, allow_parallel: bool,
                special_token_ids: Mapping[str, int] | None = None) -> str:
        m = {marker: g.marker(marker, special_token_ids) for marker in (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL)}
        rules = []
        names = []
        for number, function in enumerate(g.selected_functions(tools, forced_name)):
            names.append(f"fn_{number}")
            rules.append(f"fn_{number}: {g.literal(function['name'])} \" \" {m[CONSTRAIN]} \"json\" {m[MESSAGE]} "
                         f"args_{number} {m[CALL]}")
            rules.append(f"args_{number}: %json {g.schema_json(g.arguments_schema(function))}")
        rules.append("call_rest: " + " | ".join(names))
        # One call per reply: <|call|> ends generation (the tool's answer comes back in the next prompt).
        if not required:  # right after the lazy trigger " to=functions."
            return g.assemble("start: call_rest", rules)
        rules.append(f'analysis: {m[CHANNEL]} "analysis" {m[MESSAGE]} THOUGHT {m[END]} {m[START]} "assistant"')
        rules.append(f'call: {m[CHANNEL]} "commentary to=functions." call_rest')
        return g.assemble("start: analysis? call", rules, r"THOUGHT: /(?s:.*)/")
