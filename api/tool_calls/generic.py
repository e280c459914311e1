"""The generic format, for templates that do not render tools (SmolLM2, Gemma 3).

The server itself puts the tools and the answer format into the system prompt. A reply that calls tools is
one JSON object, ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``; a direct answer is plain text
(it must not start with ``{``), so the model ends it with its own end-of-turn token, as it was trained to: a
JSON string answer (``{"response": "..."}``, llama.cpp's choice) cannot end until the model closes the quote,
and a small model then writes on until max_tokens. The parser still reads ``{"response": "..."}`` (streams the
decoded string as content); any other reply is content as written.
"""
from __future__ import annotations

import json
from typing import Mapping

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import OutputParser, ToolFormat, function_specs, parameters_schema
from api.tool_calls.json_call import JsonCallObjectParser
from api.tool_calls.json_scan import JsonScanner, JsonStringDecoder
from api.tool_calls.stream_base import ToolCallStreamParser

_WHITESPACE = " \t\n\r"
# A direct answer: any text whose first non-blank character is not "{" (that one begins the tool-call object).
ANSWER_TEXT_TERMINAL = r"ANSWER_TEXT: /[ \t\r\n]*[^{ \t\r\n][\s\S]*/"


class GenericParser(ToolCallStreamParser):
    """Walks the reply object with one scanner; each element of "tool_calls" also goes to a call parser.

    Until the first member shows which kind of reply this is, everything is held (``_raw``), so a reply that
    is not the expected object is released as content unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self._scanner = JsonScanner(capture_depth=1)
        self._state = "start"  # -> "object" -> "after" | "content"
        self._key: str | None = None
        self._kind: str | None = None  # "response" or "tool_calls", once the first member begins
        self._member: str | None = None  # the member whose value is being read
        self._response: JsonStringDecoder | None = None

    def _step(self, final: bool) -> bool:
        if self._state == "start":
            body = self._pending.lstrip(_WHITESPACE)
            self._raw += self._pending[:len(self._pending) - len(body)]
            self._pending = body
            if not body:
                return False
            self._state = "object" if body[0] == "{" else "content"
            return True
        if self._state == "object":
            return self._in_object()
        if self._state == "after":
            # after the object only whitespace is markup; anything else is content
            body = self._pending.lstrip(_WHITESPACE)
            if not body:
                self._pending = ""
                return False
            self._pending, self._state = body, "content"
            return True
        self._release_raw_as_content()
        self._emit_content(self._pending)
        self._pending = ""
        return False

    def _in_object(self) -> bool:
        for position, ch in enumerate(self._pending):
            if not self._feed_char(ch):
                self._pending = self._pending[position:]
                self._state = "content"  # held text (if not yet committed) and the rest are content
                return True
            if self._scanner.done:
                self._pending = self._pending[position + 1:]
                if self._kind is None:  # a JSON object without our members (e.g. "{}"): all content
                    self._release_raw_as_content()
                    self._state = "content"
                else:
                    self._raw, self._state = "", "after"
                return True
        self._pending = ""
        return False

    def _feed_char(self, ch: str) -> bool:
        events = self._scanner.feed(ch)
        if events is None:
            return False
        if self._member == "tool_calls" and self._call is not None:
            self._pending_call_char(ch)
        elif self._member == "response" and self._response is not None and not events:
            self._emit_content(self._response.feed(ch))
        for event in events:
            if event.kind == "key" and event.depth == 1:
                self._key = json.loads(event.raw)
            elif event.kind == "start" and event.depth == 1:
                if not self._member_starts(ch):
                    return False
            elif event.kind == "end" and event.depth == 1:
                if self._member == "response" and self._response is not None:
                    self._emit_content(self._response.flush())
                self._member = self._response = None
            elif event.kind == "start" and event.depth == 2 and self._member == "tool_calls":
                if ch != "{":
                    return False
                self._begin_call_object(JsonCallObjectParser(arguments_keys=("arguments", "parameters")))
                self._pending_call_char(ch)
        if self._kind is None:
            self._raw += ch  # held until the first member shows this is the reply object
        return True

    def _member_starts(self, ch: str) -> bool:
        wanted = {"response": '"', "tool_calls": "["}
        if self._key not in wanted or wanted[self._key] != ch:
            return self._kind is not None  # an unexpected first member: not our object; later ones are skipped
        if self._kind is None:
            self._kind, self._raw = self._key, ""  # committed: this is the reply object
        self._member = self._key
        if self._key == "response":
            self._response = JsonStringDecoder()
        return True

    def _pending_call_char(self, ch: str) -> None:
        """Pass one character to the current call object, emitting its header and arguments as they come."""
        assert self._call is not None
        self._call.feed(ch)
        if self._call.name is not None and not self._call_started:
            self._start_call(self._call.name)
            self._call_started = True
        if self._call_started:
            self._emit_arguments(self._call.take_arguments())
        if self._call.state != "open":  # done, or not a call (an element without a name is skipped)
            self._call, self._call_started = None, False

    def _finish_open(self) -> None:
        if self._kind is None:
            self._release_raw_as_content()
        if self._state == "content":
            self._emit_content(self._pending)
        elif self._member == "response" and self._response is not None:
            self._emit_content(self._response.flush())
        self._pending = ""


class GenericFormat(ToolFormat):
    """Tools described in the system prompt by the server; the reply is constrained JSON from the first token."""

    name = "generic"
    renders_in_template = False
    lazy_trigger = None
    json_answers = False  # a direct answer is plain text (see the module docstring)

    def create_parser(self, tools: list[dict]) -> OutputParser:
        return GenericParser()

    def grammar(self, tools: list[dict], *, required: bool, forced_name: str | None, allow_parallel: bool,
                special_token_ids: Mapping[str, int] | None = None) -> str:
        rules = g.json_call_rules(tools, forced_name, arguments_key="arguments")
        # The canonical layout of grammar_parts: what rewrite_history renders for the same reply next turn.
        more = ' (", " call_object)*' if allow_parallel else ""
        # "{" on its own: a lexeme of its own lets `calls` stand beside a JSON answer (%json) in one grammar.
        rules.append(f'calls: "{{" {g.literal(chr(34) + "tool_calls" + chr(34) + ": [")} call_object{more} "]}}"')
        if required:
            return g.assemble("start: calls", rules)
        answer, answer_rules, terminals = self._answer_parts()
        return g.assemble(f"start: calls | {answer}", rules + answer_rules, *terminals)

    def answer_only_grammar(self) -> str:
        """The reply when tools are described but tool_choice is "none": a direct answer only."""
        answer, rules, terminals = self._answer_parts()
        return g.assemble(f"start: {answer}", rules, *terminals)

    def _answer_parts(self) -> tuple[str, list[str], tuple[str, ...]]:
        """(the direct answer's symbol, its rules, its terminals)."""
        if not self.json_answers:
            return "ANSWER_TEXT", [], (ANSWER_TEXT_TERMINAL,)
        # The closing quote and brace are optional, so the model's end-of-turn token stays allowed inside the
        # string: without that a small model could not stop (Codex on SmolLM2 wrote "...:</response>" until
        # max_output_tokens). A reply that ends inside the string is its decoded text (GenericParser).
        head = g.literal('"response": "')
        return "answer_object", [f'answer_object: "{{" {head} ANSWER_CHARS (ANSWER_END)?'], (
            r'ANSWER_CHARS: /([^"\\\x00-\x1f]|\\(["\\\/bfnrt]|u[0-9a-fA-F]{4}))*/',
            r'ANSWER_END: /"\}/')

    def system_prompt(self, tools: list[dict]) -> str | None:
        """The tool list and the exact answer format. Deterministic (the conversation cache needs the same
        tools to give byte-identical text): only the tools' content and order shape it, never the request's
        tool_choice (agents switch it between turns; the grammar enforces it instead). Keys keep the
        client's order, which is also the property order the grammar enforces."""
        lines = ["You can call the following tools:", ""]
        for function in function_specs(tools):
            lines.append(f"- {function['name']}: {str(function.get('description') or '').strip()}")
            lines.append("  parameters: " + json.dumps(parameters_schema(function), ensure_ascii=False))
        lines.append("")
        calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}]}'
        lines.append(f"To call one or more tools, reply as: {calls}")
        if self.json_answers:
            lines.append('To answer directly, reply as: {"response": "<your answer>"}')
        else:
            lines.append("To answer directly, reply with the answer as plain text (not JSON).")
        lines.append('Tool results come back to you as "Result of <tool name>:" followed by its output; once they '
                     "answer the question, reply with the answer instead of calling the tool again.")
        return "\n".join(lines)


class GenericJsonFormat(GenericFormat):
    """llama.cpp's generic format: every reply is JSON, ``{"tool_calls": [...]}`` or ``{"response": "..."}``.

    Chosen with ``--tool-call-format generic_json``. The model no longer weighs "{" against any text as its
    first token, only the two keys after ``{"``: very small models that never open a call unprompted
    (SmolLM2-135M, measured) then call tools, at the cost the module docstring names: an answer ends only
    when the model closes its string.
    """

    name = "generic_json"
    json_answers = True
    # llama-server's default: one call per reply unless parallel_tool_calls says otherwise (SmolLM2, allowed
    # more, repeats the same call until max_tokens)
    parallel_by_default = False
