"""Qwen3-Coder tool calls: XML-ish tags with one parameter per block, values as plain text.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

The arguments JSON is built from the parameters: a value is typed by the tool's JSON schema (see
``qwen3_coder_values``). String values stream as they arrive; typed ones are sent when complete.
One newline right after ``<parameter=KEY>`` and one right before ``</parameter>`` belong to the markup.
"""
from __future__ import annotations

import json
from typing import Mapping

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import OutputParser, ToolFormat, function_specs, parameters_schema
from api.tool_calls.qwen3_coder_values import convert_value, function_block_rules, is_plain_string, property_types
from api.tool_calls.stream_base import ToolCallStreamParser, partial_marker_length

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
# a value ends at its closing tag; a forgotten one is tolerated when the next tag starts
_VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)
_WHITESPACE = " \t\n\r"


class Qwen3CoderParser(ToolCallStreamParser):
    """States: "text" -> "function" -> "body" <-> "value" -> "after_function" -> "text"."""

    def __init__(self, tools: list[dict]) -> None:
        super().__init__()
        self._schemas = {spec["name"]: parameters_schema(spec) for spec in function_specs(tools)}
        self._state = "text"
        self._function = ""
        self._num_params = 0
        self._value_types: set[str] | None = None
        self._value_streams = False  # a plain string value: sent as it arrives
        self._value_text = ""  # a typed value, collected until it ends
        self._value_began = False  # the newline after the opening tag has been dealt with

    def _step(self, final: bool) -> bool:
        handler = {"text": self._in_text, "function": self._in_function, "body": self._in_body,
                   "value": self._in_value, "after_function": self._after_function}[self._state]
        return handler(final)

    def _in_text(self, final: bool) -> bool:
        if self._scan_text((OPEN,), final) is None:
            return False
        self._raw, self._state = OPEN, "function"
        return True

    def _read_tag(self, prefix: str) -> str | None:
        """Consume ``PREFIX...>`` at the start of the pending text and return the inner text; None if incomplete."""
        end = self._pending.find(">", len(prefix))
        if end < 0:
            return None
        inner = self._pending[len(prefix):end]
        self._pending = self._pending[end + 1:]
        return inner.strip()

    def _in_function(self, final: bool) -> bool:
        body = self._pending.lstrip(_WHITESPACE)
        self._raw += self._pending[:len(self._pending) - len(body)]
        self._pending = body
        if body.startswith(FUNCTION_OPEN):
            tag_end = body.find(">")
            name = body[len(FUNCTION_OPEN):tag_end if tag_end >= 0 else len(body)].strip()
            if tag_end < 0 and not final and "<" not in name and "\n" not in name:
                return False  # the name is still arriving
            if tag_end >= 0 and name and "<" not in name and "\n" not in name:
                self._pending = body[tag_end + 1:]
                self._start_call(name)
                self._function, self._num_params, self._state = name, 0, "body"
                return True
        elif not final and FUNCTION_OPEN.startswith(body):
            return False
        self._release_raw_as_content()  # not a function block after all
        self._state = "text"
        return True

    def _in_body(self, final: bool) -> bool:
        self._pending = self._pending.lstrip(_WHITESPACE)
        pending = self._pending
        tags = (PARAMETER_OPEN, FUNCTION_CLOSE, CLOSE)
        if pending.startswith(PARAMETER_OPEN) and ">" in pending:
            key = self._read_tag(PARAMETER_OPEN)
            if key:
                self._begin_value(key)
                return True
        elif pending.startswith((FUNCTION_CLOSE, CLOSE)):
            self._close_arguments()
            ends_block = pending.startswith(CLOSE)
            self._pending = pending[len(CLOSE if ends_block else FUNCTION_CLOSE):]
            self._state = "text" if ends_block else "after_function"
            self._after_call = ends_block
            return True
        elif pending.startswith(PARAMETER_OPEN) or any(tag.startswith(pending) for tag in tags):
            if not final:
                return False  # a tag still arriving
            self._pending = ""  # a tag cut off by the end of generation: the call ends with what it has
        # anything else ends the call as it stands; the text goes on as content
        self._close_arguments()
        self._state = "text"
        return True

    def _begin_value(self, key: str) -> None:
        self._emit_arguments(("{" if self._num_params == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        self._num_params += 1
        self._value_types = property_types(self._schemas.get(self._function), key)
        self._value_streams = is_plain_string(self._value_types)
        self._value_text, self._value_began = "", False
        if self._value_streams:
            self._emit_arguments('"')
        self._state = "value"

    def _in_value(self, final: bool) -> bool:
        if not self._value_began:
            if not self._pending and not final:
                return False
            if self._pending.startswith("\n"):
                self._pending = self._pending[1:]
            self._value_began = True
        pending = self._pending
        ends = [(pending.find(tag), tag) for tag in _VALUE_ENDS if tag in pending]
        if ends:
            position, tag = min(ends)
            text = pending[:position]
            self._add_value_text(text[:-1] if text.endswith("\n") else text)
            self._pending = pending[position + len(PARAMETER_CLOSE):] if tag == PARAMETER_CLOSE else pending[position:]
            self._end_value()
            self._state = "body"
            return True
        hold = partial_marker_length(pending, _VALUE_ENDS)
        if final:
            # cut off by the end of generation: keep the value so far, without a half closing tag
            text = pending[:len(pending) - hold]
            self._add_value_text(text[:-1] if hold and text.endswith("\n") else text)
            self._pending = ""
            return False
        if pending[:len(pending) - hold].endswith("\n"):
            hold += 1  # may be the newline before the closing tag, which is markup
        self._add_value_text(pending[:len(pending) - hold])
        self._pending = pending[len(pending) - hold:]
        return False

    def _add_value_text(self, text: str) -> None:
        if self._value_streams:
            self._emit_arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value_text += text

    def _end_value(self) -> None:
        if self._value_streams:
            self._emit_arguments('"')
        else:
            value = convert_value(self._value_text, self._value_types)
            self._emit_arguments(json.dumps(value, ensure_ascii=False))

    def _close_arguments(self) -> None:
        self._emit_arguments("}" if self._num_params else "{}")

    def _after_function(self, final: bool) -> bool:
        self._pending = self._pending.lstrip(_WHITESPACE)
        if self._pending.startswith(CLOSE):
            self._pending = self._pending[len(CLOSE):]
        elif CLOSE.startswith(self._pending):
            if not final:
                return False
            self._pending = ""
        self._state, self._after_call = "text", True
        return True

    def _finish_open(self) -> None:
        if self._state == "function":
            self._release_raw_as_content()
        elif self._state == "value" and not self._value_streams and self._value_text:
            self._emit_arguments(json.dumps(convert_value(self._value_text, self._value_types), ensure_ascii=False))
        if self._state in ("text", "after_function"):
            self._release_pending()
        self._pending = ""


class Qwen3CoderFormat(ToolFormat):
    """Qwen3-Coder's ``<function=...>`` blocks inside ``<tool_call>``."""

    name = "qwen3_coder"
    markers = (OPEN, CLOSE, FUNCTION_CLOSE, PARAMETER_CLOSE)
    recovers_json_calls = True
    lazy_trigger = OPEN

    def create_parser(self, tools: list[dict]) -> OutputParser:
        return Qwen3CoderParser(tools)

    def grammar(self, tools: list[dict], *, required: bool, forced_name: str | None, allow_parallel: bool,
                special_token_ids: Mapping[str, int] | None = None) -> str:
        open_tag, close_tag = g.marker(OPEN, special_token_ids), g.marker(CLOSE, special_token_ids)
        rules = function_block_rules(g.selected_functions(tools, forced_name))
        rules.append(f"call: {open_tag} WS? function_block WS? {close_tag}")
        more = " (WS? call)*" if allow_parallel else ""
        start = f"start: call{more}" if required else f"start: WS? function_block WS? {close_tag}{more}"
        return g.assemble(start, rules)
