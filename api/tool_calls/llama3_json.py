"""Llama 3.x JSON tool calls: the whole reply is ``{"name": ..., "parameters": {...}}``.

Optionally preceded by ``<|python_tag|>``; several calls may be separated by ``;``. The model's
"parameters" become OpenAI's "arguments". Only a reply that *starts* with JSON can be a call, and the object
must look like one (only name / parameters / arguments / type members, a known function name); anything
else, including JSON the user asked for, is content.
"""
from __future__ import annotations

from typing import Mapping

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import OutputParser, ToolFormat, function_specs
from api.tool_calls.json_call import JsonCallObjectParser
from api.tool_calls.stream_base import ToolCallStreamParser

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_WHITESPACE = " \t\n\r"


class Llama3JsonParser(ToolCallStreamParser):
    """States: "start" -> "object" -> "between" -> "object" ... ; "content" once the reply is plain text."""

    def __init__(self, tools: list[dict]) -> None:
        super().__init__()
        self._names = [spec["name"] for spec in function_specs(tools)]
        self._state = "start"
        self._seen_tag = False

    def _new_object(self) -> JsonCallObjectParser:
        return JsonCallObjectParser(arguments_keys=("parameters", "arguments"), strict=True, known_names=self._names)

    def _step(self, final: bool) -> bool:
        if self._state == "content":
            self._emit_content(self._pending)
            self._pending = ""
            return False
        if self._state == "start":
            return self._at_start(final)
        if self._state == "object":
            if not self._pending:
                return False
            state = self._advance_call_object()
            if state == "done":
                self._raw, self._state = "", "between"
                self._call, self._call_started = None, False
            elif state == "failed":
                self._give_up()
            return state != "open"
        return self._between(final)

    def _at_start(self, final: bool) -> bool:
        # everything before the first call is held in _raw, so a reply that is not a call loses nothing
        body = self._pending.lstrip(_WHITESPACE)
        self._raw += self._pending[:len(self._pending) - len(body)]
        self._pending = body
        if not self._seen_tag and body.startswith(PYTHON_TAG):
            self._raw += PYTHON_TAG
            self._pending, self._seen_tag = body[len(PYTHON_TAG):], True
            return True
        if not body or (not final and not self._seen_tag and PYTHON_TAG.startswith(body)):
            return False
        if body[0] == "{":
            self._begin_call_object(self._new_object())
            self._state = "object"
        else:
            self._give_up()
        return True

    def _between(self, final: bool) -> bool:
        # after a call: ";" (or just whitespace) and another call object, or the end
        body = self._pending.lstrip(_WHITESPACE)
        self._raw += self._pending[:len(self._pending) - len(body)]
        self._pending = body
        if body.startswith(SEPARATOR) and SEPARATOR not in self._raw:
            self._raw += SEPARATOR
            self._pending = body[len(SEPARATOR):]
            return True
        if not body:
            return False
        if body[0] == "{":
            self._begin_call_object(self._new_object())
            self._state = "object"
        else:
            self._give_up()
        return True

    def _give_up(self) -> None:
        """Not (or no longer) a call: the held text and everything after it is content."""
        if self._call_started:
            self._raw = ""  # the emitted call stands; only what follows is content
        self._release_raw_as_content()
        self._state = "content"

    def _finish_open(self) -> None:
        if self._state == "start" or (self._state == "object" and not self._call_started):
            self._release_raw_as_content()
        # "between": whitespace or a trailing ";" after the last call is markup, dropped
        self._emit_content(self._pending)
        self._pending = ""


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1 / 3.2 / 3.3 custom tools: bare JSON objects with "parameters"."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)
    # the lazy grammar starts right after the call's opening, and only at the start of the reply
    lazy_trigger = '{"name"'
    trigger_only_at_start = True

    def create_parser(self, tools: list[dict]) -> OutputParser:
        return Llama3JsonParser(tools)

    def grammar(self, tools: list[dict], *, required: bool, forced_name: str | None, allow_parallel: bool,
                special_token_ids: Mapping[str, int] | None = None) -> str:
        rules = g.json_call_rules(tools, forced_name, arguments_key="parameters")
        more = f' (WS? {g.literal(SEPARATOR)} WS? call_object)*' if allow_parallel else ""
        if required:
            tag = g.marker(PYTHON_TAG, special_token_ids)
            start = f"start: ({tag} WS?)? call_object{more}"
        else:
            start = f"start: call_rest{more}"
        return g.assemble(start, rules)
