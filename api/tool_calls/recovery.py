"""The streaming parser that recovers tool calls written as JSON objects (api/tool_calls/recovered_call.py says
which objects are calls), around a format's own parser.

It reads the content the format's parser lets through. Text that may begin a call (a line starting with
``{``, or a fence line) is held back until decided: a call is emitted whole once its object has closed and its
arguments validated; anything else is released as content, character for character, so nothing is lost and
no call text ever leaks into content. The format's own calls pass through, numbered in one sequence with the
recovered ones.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from api.tool_calls.base import OutputParser, ParsedDelta, ToolCallDelta, function_specs, new_call_id
from api.tool_calls.json_scan import JsonScanner
from api.tool_calls.recovered_call import CALL_KEYS, FENCE_LANGUAGES, RecoveredCall, call_from_object, call_key

FENCE = "```"
_BLANK = " \t"
_WHITESPACE = " \t\r\n"
_LONGEST_FENCE_LINE = 32  # past this a line that began with ``` is not a fence of a language we know


@dataclass
class _Candidate:
    """Held text that may be a call: ``raw`` is every character consumed since the line began."""

    raw: str
    fenced: bool
    phase: str = "gap"  # "gap" (before "{"), "object", "close" (after the object, before the closing fence)
    scanner: JsonScanner = field(default_factory=lambda: JsonScanner(capture_depth=1))
    text: list[str] = field(default_factory=list)  # the object's characters
    key: str | None = None
    call: RecoveredCall | None = None


class RecoveringParser:
    """Wraps a format's parser; ``on_recovered(shape)`` is called for each recovered call ("fenced" or
    "bare", with " function-wrapper" appended for the ``"function": {...}`` spelling). ``answered`` holds the
    ``call_key``s of the calls the prompt's closing tool results answer: restating one is content."""

    def __init__(self, inner: OutputParser, tools: list[dict],
                 on_recovered: Callable[[str], None] | None = None,
                 answered: frozenset[tuple[str, str]] = frozenset()) -> None:
        self._inner = inner
        self._functions = {spec["name"]: spec for spec in function_specs(tools)}
        self._answered = answered
        self._on_recovered = on_recovered
        self._pending = ""  # content from the inner parser, not yet decided
        self._line_start = True  # the pending text begins a line
        self._fence: str | None = None  # an open fenced block we pass through: "foreign" (another language) or "json"
        self._candidate: _Candidate | None = None
        self._after_call = False  # whitespace right after a recovered call is dropped if nothing else follows
        self._num_calls = 0
        self._inner_index: dict[int, int] = {}
        self._out = ParsedDelta()

    @property
    def num_tool_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> ParsedDelta:
        return self._process(self._inner.feed(text), final=False)

    def finish(self) -> ParsedDelta:
        return self._process(self._inner.finish(), final=True)

    def _process(self, delta: ParsedDelta, final: bool) -> ParsedDelta:
        self._out.reasoning += delta.reasoning
        self._pending += delta.content
        while self._step(final):
            pass
        if final:
            self._finish_held()
        # The format's own calls, renumbered into the one sequence after the recovered calls decided so far
        # (its markup follows the content that came with it).
        for call in delta.tool_calls:
            if call.index not in self._inner_index:
                self._inner_index[call.index] = self._num_calls
                self._num_calls += 1
            self._out.add_call_delta(ToolCallDelta(self._inner_index[call.index], call.id, call.name, call.arguments))
        out, self._out = self._out, ParsedDelta()
        return out

    # -- text between candidates ----------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        if self._candidate is not None:
            return self._advance_candidate(final)
        if not self._pending:
            return False
        if self._after_call:
            body = self._pending.lstrip(_WHITESPACE)
            if not body:
                return False  # only whitespace so far: dropped if the reply ends here
            gap, self._pending, self._after_call = self._pending[:len(self._pending) - len(body)], body, False
            self._line_start = "\n" in gap
            if not (self._line_start and body[0] in "{`"):  # between two calls whitespace is markup
                self._out.content += gap
        if not self._line_start:
            end = self._pending.find("\n")
            self._emit_content_prefix(len(self._pending) if end < 0 else end + 1)
            return bool(self._pending)
        return self._at_line_start(final)

    def _at_line_start(self, final: bool) -> bool:
        # blank lines before a call belong to it (dropped with its markup); before anything else, to the content
        head = self._pending.lstrip(_WHITESPACE)
        indent = len(self._pending) - len(head)
        if not head:
            if final:
                self._emit_content_prefix(len(self._pending))
            return False
        if head.startswith(FENCE) or (FENCE.startswith(head) and not final):
            return self._fence_line(head, indent, final)
        if head[0] == "{" and self._fence != "foreign":
            self._begin(indent, fenced=False)
            return True
        self._emit_line()
        return True

    def _fence_line(self, head: str, indent: int, final: bool) -> bool:
        newline = head.find("\n")
        if newline < 0:
            if not final and len(head) <= _LONGEST_FENCE_LINE:
                return False  # the fence line is still arriving
            self._emit_line()
            return bool(self._pending)
        language = head[len(FENCE):newline].strip(_WHITESPACE)
        if self._fence is not None:  # the closing fence of a block passed through as content
            self._fence = None
            self._emit_line()
        elif language.lower() in FENCE_LANGUAGES and " " not in language:
            self._begin(indent + newline + 1, fenced=True)
        else:
            self._fence = "foreign"
            self._emit_line()
        return True

    # -- a candidate ----------------------------------------------------------------------------------
    def _begin(self, consumed: int, fenced: bool) -> None:
        self._candidate = _Candidate(self._pending[:consumed], fenced, phase="gap" if fenced else "object")
        self._pending = self._pending[consumed:]

    def _advance_candidate(self, final: bool) -> bool:
        cand = self._candidate
        if cand.phase == "gap":
            body = self._pending.lstrip(_WHITESPACE)
            cand.raw += self._pending[:len(self._pending) - len(body)]
            self._pending = body
            if not body:
                if final:
                    self._release(fence_open=True)
                return False
            if body[0] != "{":
                self._release(fence_open=True)
                return True
            cand.phase = "object"
        if cand.phase == "object":
            return self._scan_object(final)
        return self._close_fence(final)

    def _scan_object(self, final: bool) -> bool:
        cand = self._candidate
        for position, ch in enumerate(self._pending):
            events = cand.scanner.feed(ch)
            if events is None or not self._members_may_be_a_call(cand, events):
                self._pending = self._pending[position:]
                self._release(fence_open=cand.fenced)
                return True
            cand.raw += ch
            cand.text.append(ch)
            if cand.scanner.done:
                self._pending = self._pending[position + 1:]
                cand.call = call_from_object(json.loads("".join(cand.text)), self._functions)
                if cand.call is not None and call_key(cand.call.name, cand.call.arguments) in self._answered:
                    cand.call = None  # the model restating the call the tool just answered
                if cand.call is None:
                    self._release(fence_open=cand.fenced)
                elif cand.fenced:
                    cand.phase = "close"
                else:
                    self._emit_call()
                return True
        self._pending = ""
        if final:
            self._release(fence_open=cand.fenced)
        return False

    def _members_may_be_a_call(self, cand: _Candidate, events) -> bool:
        """Fail fast on the first top-level member no call has, or a name that is not a declared tool."""
        for event in events:
            if event.depth != 1:
                continue
            if event.kind == "key":
                cand.key = json.loads(event.raw)
                if cand.key not in CALL_KEYS:
                    return False
            elif event.kind == "end" and cand.key == "name" and event.raw is not None:
                if json.loads(event.raw) not in self._functions:
                    return False
        return True

    def _close_fence(self, final: bool) -> bool:
        body = self._pending.lstrip(_WHITESPACE)
        if not body and not final:
            return False
        if body.startswith(FENCE):
            self._pending = body[len(FENCE):]
        elif not final and FENCE.startswith(body):
            return False
        elif body.startswith("{"):  # another call in the same block
            self._pending = body
            self._emit_call()
            self._candidate = _Candidate("", fenced=True, phase="object")
            return True
        self._emit_call()
        return True

    def _emit_call(self) -> None:
        cand = self._candidate
        call = cand.call
        self._out.add_call_delta(ToolCallDelta(self._num_calls, new_call_id(), call.name,
                                               json.dumps(call.arguments, ensure_ascii=False)))
        self._num_calls += 1
        self._candidate, self._after_call, self._line_start = None, True, False
        if self._on_recovered is not None:
            self._on_recovered(("fenced" if cand.fenced else "bare") + (" function-wrapper" if call.wrapped else ""))

    def _release(self, fence_open: bool) -> None:
        """The held text is not a call: it is content, as written."""
        raw = self._candidate.raw
        self._candidate = None
        self._out.content += raw
        self._line_start = raw.endswith("\n")
        if fence_open:
            self._fence = "json"

    def _finish_held(self) -> None:
        if self._candidate is not None and self._candidate.phase == "close":
            self._emit_call()  # a block whose closing fence never came
        elif self._candidate is not None:
            self._release(fence_open=False)
        if not self._after_call:
            self._out.content += self._pending
        self._pending = ""

    # -- content --------------------------------------------------------------------------------------
    def _emit_line(self) -> None:
        end = self._pending.find("\n")
        self._emit_content_prefix(len(self._pending) if end < 0 else end + 1)

    def _emit_content_prefix(self, length: int) -> None:
        text, self._pending = self._pending[:length], self._pending[length:]
        self._out.content += text
        if text:
            self._line_start = text.endswith("\n")
