"""Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Several calls may follow each other, with text before and after. A missing ``</tool_call>`` is tolerated
(the call ends with its JSON object); ``<tool_call>`` followed by anything but a call object is content.
"""
from __future__ import annotations

from typing import Mapping

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import OutputParser, ToolFormat
from api.tool_calls.json_call import JsonCallObjectParser
from api.tool_calls.stream_base import ToolCallStreamParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_WHITESPACE = " \t\n\r"


class HermesParser(ToolCallStreamParser):
    """States: "text" -> (``<tool_call>``) "open" -> ("{") "object" -> "close" -> "text"."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            marker = self._scan_text((OPEN,), final)
            if marker is None:
                return False
            self._raw, self._state = marker, "open"
            return True
        if self._state == "open":
            body = self._pending.lstrip(_WHITESPACE)
            self._raw += self._pending[:len(self._pending) - len(body)]
            self._pending = body
            if not body:
                return False
            if body[0] != "{":
                self._release_raw_as_content()
                self._state = "text"
            else:
                self._begin_call_object(JsonCallObjectParser())
                self._state = "object"
            return True
        if self._state == "object":
            if not self._pending:
                return False
            state = self._advance_call_object()
            if state == "done":
                self._state = "close"
            elif state == "failed":
                self._abandon_call()
            return state != "open"
        # "close": the whitespace and closing tag after the object are markup, never content
        self._pending = self._pending.lstrip(_WHITESPACE)
        if self._pending.startswith(CLOSE):
            self._pending = self._pending[len(CLOSE):]
        elif CLOSE.startswith(self._pending):
            if not final:
                return False  # empty, or a closing tag still arriving
            self._pending = ""  # a closing tag cut off by the end of generation
        self._state, self._after_call = "text", True
        return True

    def _abandon_call(self) -> None:
        if self._call_started:
            self._raw = ""  # the call was emitted: keep it as it is; what follows is text again
        else:
            self._release_raw_as_content()
        self._state = "text"

    def _finish_open(self) -> None:
        if self._state in ("open", "object") and not self._call_started:
            self._release_raw_as_content()
        if self._state in ("text", "close"):
            self._release_pending()
        self._pending = ""


class HermesFormat(ToolFormat):
    """``<tool_call>`` JSON blocks, as the Hermes 2 Pro and Qwen2.5/Qwen3 templates teach."""

    name = "hermes"
    markers = (OPEN, CLOSE)
    lazy_trigger = OPEN
    recovers_json_calls = True

    def create_parser(self, tools: list[dict]) -> OutputParser:
        return HermesParser()

    def grammar(self, tools: list[dict], *, required: bool, forced_name: str | None, allow_parallel: bool,
                special_token_ids: Mapping[str, int] | None = None) -> str:
        open_tag = g.marker(OPEN, special_token_ids)
        close_tag = g.marker(CLOSE, special_token_ids)
        rules = g.json_call_rules(tools, forced_name, arguments_key="arguments")
        # The Hermes / Qwen templates' own layout, so a reply re-renders byte-identically from the history.
        rules.append(f'call: {open_tag} "\\n" call_object "\\n" {close_tag}')
        more = ' ("\\n" call)*' if allow_parallel else ""
        if required:
            start = f"start: call{more}"
        else:  # right after the lazy trigger, which is the opening tag
            start = f'start: "\\n" call_object "\\n" {close_tag}{more}'
        return g.assemble(start, rules)
