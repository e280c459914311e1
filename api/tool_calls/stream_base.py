"""The machinery the format parsers share: buffering, holding back possible markers, emitting deltas.

A parser is a small state machine over ``self._pending`` (input not consumed yet). ``_step`` handles the
current state and returns whether it made progress; it runs until it cannot without more input. With
``final`` (from ``finish()``) nothing more will come, so held-back text must be decided.
"""
from __future__ import annotations

from typing import Iterable

from api.tool_calls.base import ParsedDelta, ToolCallDelta, new_call_id
from api.tool_calls.json_call import JsonCallObjectParser

_WHITESPACE = " \t\n\r"


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is the start (not the whole) of one of ``markers``.

    That much must be held back: the next piece of output may complete the marker.
    """
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best


def find_first_marker(text: str, markers: Iterable[str]) -> tuple[int, str | None]:
    """Position and text of the earliest of ``markers`` in ``text``; (-1, None) if none occurs."""
    found, which = -1, None
    for marker in markers:
        position = text.find(marker)
        if position >= 0 and (found < 0 or position < found):
            found, which = position, marker
    return found, which


class ToolCallStreamParser:
    """Base of the format parsers. Subclasses implement ``_step`` and may override ``_finish_open``."""

    def __init__(self) -> None:
        self._pending = ""
        self._out = ParsedDelta()
        self._num_calls = 0
        self._after_call = False  # whitespace right after a call is held: dropped before a call or the end
        self._raw = ""  # the text of the call being parsed, from its marker on: content again if it fails
        self._call: JsonCallObjectParser | None = None
        self._call_started = False  # the current call's header (id, name) has been emitted

    @property
    def num_tool_calls(self) -> int:
        """Calls started so far."""
        return self._num_calls

    def feed(self, text: str) -> ParsedDelta:
        """Take the next decoded piece of output; return what is now certain."""
        self._pending += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of generation: decide everything still held back."""
        while self._step(final=True):
            pass
        self._finish_open()
        return self._take()

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _finish_open(self) -> None:
        """Called once at the end, after the last ``_step``: release whatever a cut-off state holds."""
        self._release_pending()

    def _release_pending(self) -> None:
        """The held-back text becomes content, unless it is only whitespace after a call."""
        if self._pending.strip(_WHITESPACE) or not self._after_call:
            self._emit_content(self._pending)
        self._pending = ""

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    def _emit_content(self, text: str) -> None:
        self._out.content += text

    def _start_call(self, name: str) -> None:
        self._out.add_call_delta(ToolCallDelta(self._num_calls, new_call_id(), name))
        self._num_calls += 1

    def _emit_arguments(self, text: str) -> None:
        if text:
            self._out.add_call_delta(ToolCallDelta(self._num_calls - 1, arguments=text))

    def _scan_text(self, markers: tuple[str, ...], final: bool) -> str | None:
        """Text mode: emit content up to the first marker and consume the marker, returning it.

        Returns None when no marker is complete yet; the end of the text that may start one is held back.
        Whitespace right after a call is dropped when a marker or the end follows, else it is content.
        """
        text = self._pending
        if self._after_call:
            body = text.lstrip(_WHITESPACE)
            if body.startswith(markers) or (not body and final):
                self._pending, self._after_call = body, False
                return self._scan_text(markers, final) if body else None
            if not body or (not final and any(marker.startswith(body) for marker in markers)):
                return None  # cannot tell yet whether a call or text follows the whitespace
            self._after_call = False
        position, marker = find_first_marker(text, markers)
        if marker is not None:
            self._emit_content(text[:position])
            self._pending = text[position + len(marker):]
            return marker
        hold = 0 if final else partial_marker_length(text, markers)
        self._emit_content(text[:len(text) - hold])
        self._pending = text[len(text) - hold:]
        return None

    def _skip_whitespace(self) -> bool:
        """Drop leading whitespace of the pending text; True if something else follows it."""
        self._pending = self._pending.lstrip(_WHITESPACE)
        return bool(self._pending)

    def _begin_call_object(self, parser: JsonCallObjectParser) -> None:
        self._call, self._call_started = parser, False

    def _advance_call_object(self) -> str:
        """Feed pending text to the current call object; emit its header and arguments once the name is known.

        Returns the object parser's state: "open" (needs more), "done", or "failed".
        """
        assert self._call is not None
        consumed = self._call.feed(self._pending)
        if not self._call_started:  # once the call is out, its text can no longer become content
            self._raw += self._pending[:consumed]
        self._pending = self._pending[consumed:]
        if self._call.name is not None and not self._call_started:
            self._start_call(self._call.name)
            self._call_started = True
        if self._call_started:
            self._emit_arguments(self._call.take_arguments())
        return self._call.state

    def _release_raw_as_content(self) -> None:
        """The text since the call's marker was not a call after all: it is content, never lost."""
        self._emit_content(self._raw)
        self._raw = ""
        self._call, self._call_started = None, False
