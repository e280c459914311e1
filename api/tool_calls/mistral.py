"""Mistral tool calls, both generations, after the ``[TOOL_CALLS]`` marker:

- older (v3 tokenizers, Mistral 7B v0.3, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]``
- newer (v11+, Mistral Small 3.2, Devstral, Magistral): ``[TOOL_CALLS]NAME[ARGS]{...}``, repeated per call,
  sometimes with ``[CALL_ID]id`` before ``[ARGS]``.

Text before the marker is content. The model's ids are not used: every call gets a fresh OpenAI-style id.
"""
from __future__ import annotations

import re
from typing import Mapping

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import OutputParser, ToolFormat
from api.tool_calls.json_call import JsonCallObjectParser
from api.tool_calls.json_scan import JsonScanner
from api.tool_calls.stream_base import ToolCallStreamParser, partial_marker_length

MARKER = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_WHITESPACE = " \t\n\r"


class MistralParser(ToolCallStreamParser):
    """States: "text" -> "marker" -> array ("item", "object", "separator") or named ("name", "call_id", "args")."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"
        self._name = ""
        self._scanner: JsonScanner | None = None

    def _take_whitespace(self) -> str:
        body = self._pending.lstrip(_WHITESPACE)
        self._raw += self._pending[:len(self._pending) - len(body)]
        self._pending = body
        return body

    def _consume(self, count: int) -> None:
        self._raw += self._pending[:count]
        self._pending = self._pending[count:]

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == "text":
            if self._scan_text((MARKER,), final) is None:
                return False
            self._raw, self._state = MARKER, "marker"
            return True
        if state == "object":
            if not self._pending:
                return False
            result = self._advance_call_object()
            if result == "done":
                self._raw, self._state = "", "separator"
                self._call, self._call_started = None, False
            elif result == "failed":
                self._abandon_call()
            return result != "open"
        if state == "args":
            return self._in_args()
        if state == "name":
            return self._in_name(final)
        if state == "call_id":
            end = self._pending.find(ARGS)
            if end < 0:  # the id so far, without the start of an [ARGS] still arriving
                call_id = self._pending[:len(self._pending) - partial_marker_length(self._pending, (ARGS,))]
            else:
                call_id = self._pending[:end]
            if not _NAME_CHARS.fullmatch(call_id) or (end < 0 and final):
                self._abandon_call()  # not an id followed by [ARGS]: the text is content
                return True
            if end < 0:
                return False
            self._consume(end + len(ARGS))
            self._state = "args_open"
            return True
        body = self._take_whitespace()
        if not body:
            return False
        first = body[0]
        if state == "marker":
            if first == "[":
                self._consume(1)
                self._state = "item"
            elif _NAME_CHARS.match(first).group():
                self._name, self._state = "", "name"
            else:
                self._abandon_call()
        elif state == "item":  # inside the array, before a call object
            if first == "{":
                self._begin_call_object(JsonCallObjectParser(arguments_keys=("arguments", "parameters")))
                self._state = "object"
            else:
                self._abandon_call()
        elif state == "separator":  # after a call object in the array
            if first == "," or first == "]":
                self._pending = body[1:]
                self._state, self._after_call = ("item", False) if first == "," else ("text", True)
            else:
                self._state = "text"  # the array was not closed; what follows is text
        elif state == "args_open":
            if first != "{":
                self._abandon_call()
            else:
                self._start_call(self._name)
                self._call_started, self._scanner, self._raw = True, JsonScanner(capture_depth=0), ""
                self._state = "args"
        return True

    def _in_name(self, final: bool) -> bool:
        name = _NAME_CHARS.match(self._pending).group()
        rest = self._pending[len(name):]
        if not rest and not final:
            return False  # the name is still arriving
        for tag, next_state in ((ARGS, "args_open"), (CALL_ID, "call_id")):
            if rest.startswith(tag) and name:
                self._name = name
                self._consume(len(name) + len(tag))
                self._state = next_state
                return True
        if not final and (ARGS.startswith(rest) or CALL_ID.startswith(rest)):
            return False
        self._abandon_call()
        return True

    def _in_args(self) -> bool:
        assert self._scanner is not None
        for position, ch in enumerate(self._pending):
            if self._scanner.feed(ch) is None:
                self._emit_arguments(self._pending[:position])
                self._pending = self._pending[position:]
                self._state = "text"  # the emitted call stands as it is; the rest is text
                return True
            if self._scanner.done:
                self._emit_arguments(self._pending[:position + 1])
                self._pending = self._pending[position + 1:]
                self._state, self._after_call = "text", True
                return True
        self._emit_arguments(self._pending)
        self._pending = ""
        return False

    def _abandon_call(self) -> None:
        if self._call_started:
            self._raw = ""  # the emitted call stands; only what follows is text
        self._release_raw_as_content()
        self._state = "text"

    def _finish_open(self) -> None:
        if self._state in ("marker", "item", "name", "call_id", "args_open") or (
                self._state == "object" and not self._call_started):
            self._release_raw_as_content()
            self._emit_content(self._pending)
        elif self._state in ("text", "separator"):
            self._release_pending()
        self._pending = ""


class MistralFormat(ToolFormat):
    """Mistral's ``[TOOL_CALLS]`` marker with either call syntax (the model picks the one it was trained on)."""

    name = "mistral"
    markers = (MARKER, ARGS, CALL_ID)
    recovers_json_calls = True
    lazy_trigger = MARKER

    def create_parser(self, tools: list[dict]) -> OutputParser:
        return MistralParser()

    def grammar(self, tools: list[dict], *, required: bool, forced_name: str | None, allow_parallel: bool,
                special_token_ids: Mapping[str, int] | None = None) -> str:
        marker = g.marker(MARKER, special_token_ids)
        args_tag = g.marker(ARGS, special_token_ids)
        call_id = g.literal('"id"')
        rules = g.json_call_rules(tools, forced_name, arguments_key="arguments",
                                  extra_members=f'(WS? "," WS? {call_id} WS? ":" WS? CALL_ID_STRING)? ')
        named = []
        for number, function in enumerate(g.selected_functions(tools, forced_name)):
            named.append(f"named_{number}")
            rules.append(f"named_{number}: {g.literal(function['name'])} {args_tag} args_{number}")
        rules.append("named_call: " + " | ".join(named))
        more_items = ' (WS? "," WS? call_object)*' if allow_parallel else ""
        more_named = f" (WS? {marker} named_call)*" if allow_parallel else ""
        rules.append(f'array_calls: "[" WS? call_object{more_items} WS? "]"')
        rules.append(f"named_calls: named_call{more_named}")
        body = "(array_calls | named_calls)"
        start = f"start: {marker} {body}" if required else f"start: {body}"
        return g.assemble(start, rules, r'CALL_ID_STRING: /"[A-Za-z0-9]{9}"/')
