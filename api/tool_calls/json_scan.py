"""Incremental JSON: a strict character-by-character validator with structural events, and a string decoder.

Streaming parsers need to know, for every character of a JSON value, whether it is still a valid prefix
(so a fragment sent to the client never has to be taken back), and where keys and values begin and end.
Re-parsing the whole text on every token would be quadratic in the arguments length; this is linear.
"""
from __future__ import annotations

from typing import NamedTuple

_WHITESPACE = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# number states in which the number may end here
_NUMBER_CAN_END = {"num_zero", "num_int", "num_frac", "num_exp_digits"}


class JsonEvent(NamedTuple):
    """``kind`` "start" (a value begins with this char), "end" (a value ended), or "key" (a key string ended).

    ``depth`` is the number of open containers around the value: 0 for the top-level value, 1 for the members
    of the top-level object. ``raw`` is the raw JSON text of a key, or of a string value at depth <= the
    scanner's ``capture_depth``.
    """

    kind: str
    depth: int
    raw: str | None = None


class JsonScanner:
    """Validates one JSON value fed one character at a time and reports structural events.

    ``feed(ch)`` returns the events that character caused, or None if it makes the text invalid JSON (the
    scanner is then ``failed``). After the top-level value ends, ``done`` is set and no more input is taken.
    A number ends only at the character after it, so its "end" event comes with that character.
    """

    def __init__(self, capture_depth: int = 1) -> None:
        self.capture_depth = capture_depth
        self.done = False
        self.failed = False
        self._stack: list[str] = []  # "o" / "a" per open container
        self._state = "value"
        self._string_is_key = False
        self._string_raw: list[str] | None = None
        self._literal_rest = ""
        self._hex_left = 0

    @property
    def depth(self) -> int:
        return len(self._stack)

    def feed(self, ch: str) -> list[JsonEvent] | None:
        if self.done or self.failed:
            self.failed = True
            return None
        events: list[JsonEvent] = []
        if not self._step(ch, events):
            self.failed = True
            return None
        return events

    def _step(self, ch: str, events: list[JsonEvent]) -> bool:  # noqa: C901 - one branch per state
        state = self._state
        if state.startswith("num_"):
            if self._number_step(ch):
                return True
            if state not in _NUMBER_CAN_END:
                return False
            self._value_ended(events, None)  # the number ended before this char; it is structure again
            state = self._state
        if state in ("string", "escape", "unicode"):
            return self._string_step(ch, events)
        if state == "literal":
            if ch != self._literal_rest[0]:
                return False
            self._literal_rest = self._literal_rest[1:]
            if not self._literal_rest:
                self._value_ended(events, None)
            return True
        if ch in _WHITESPACE:
            return True
        if state == "value_or_close" and ch == "]":
            self._stack.pop()
            self._value_ended(events, None)
            return True
        if state in ("value", "value_or_close"):
            return self._value_start(ch, events)
        if state in ("key", "key_or_close"):
            if ch == "}" and state == "key_or_close":
                self._stack.pop()
                self._value_ended(events, None)
                return True
            if ch != '"':
                return False
            self._begin_string(is_key=True)
            return True
        if state == "colon":
            if ch != ":":
                return False
            self._state = "value"
            return True
        if state == "after_value":
            top = self._stack[-1]
            if ch == ",":
                self._state = "key" if top == "o" else "value"
                return True
            if (ch == "}" and top == "o") or (ch == "]" and top == "a"):
                self._stack.pop()
                self._value_ended(events, None)
                return True
        return False

    def _value_start(self, ch: str, events: list[JsonEvent]) -> bool:
        depth = len(self._stack)
        if ch == "{":
            self._stack.append("o")
            self._state = "key_or_close"
        elif ch == "[":
            self._stack.append("a")
            self._state = "value_or_close"
        elif ch == '"':
            self._begin_string(is_key=False)
        elif ch == "-":
            self._state = "num_sign"
        elif ch in _DIGITS:
            self._state = "num_zero" if ch == "0" else "num_int"
        elif ch in "tfn":
            self._literal_rest = {"t": "rue", "f": "alse", "n": "ull"}[ch]
            self._state = "literal"
        else:
            return False
        events.append(JsonEvent("start", depth))
        return True

    def _begin_string(self, *, is_key: bool) -> None:
        self._string_is_key = is_key
        capture = is_key or len(self._stack) <= self.capture_depth
        self._string_raw = ['"'] if capture else None
        self._state = "string"

    def _string_step(self, ch: str, events: list[JsonEvent]) -> bool:
        if self._string_raw is not None:
            self._string_raw.append(ch)
        state = self._state
        if state == "escape":
            if ch == "u":
                self._state, self._hex_left = "unicode", 4
            elif ch in _SIMPLE_ESCAPES:
                self._state = "string"
            else:
                return False
        elif state == "unicode":
            if ch not in _HEX:
                return False
            self._hex_left -= 1
            if self._hex_left == 0:
                self._state = "string"
        elif ch == "\\":
            self._state = "escape"
        elif ch == '"':
            raw = "".join(self._string_raw) if self._string_raw is not None else None
            self._string_raw = None
            if self._string_is_key:
                events.append(JsonEvent("key", len(self._stack), raw))
                self._state = "colon"
            else:
                self._value_ended(events, raw)
        elif ord(ch) < 0x20:
            return False  # raw control characters are not allowed inside JSON strings
        return True

    def _number_step(self, ch: str) -> bool:
        """Advance the number state machine; False if ``ch`` cannot continue the number."""
        state = self._state
        digit = ch in _DIGITS
        if state == "num_sign" and digit:
            self._state = "num_zero" if ch == "0" else "num_int"
        elif state in ("num_int", "num_frac", "num_exp_digits") and digit:
            pass
        elif state in ("num_zero", "num_int") and ch == ".":
            self._state = "num_dot"
        elif state in ("num_dot", "num_exp", "num_exp_sign") and digit:
            self._state = "num_frac" if state == "num_dot" else "num_exp_digits"
        elif state in ("num_zero", "num_int", "num_frac") and ch in "eE":
            self._state = "num_exp"
        elif state == "num_exp" and ch in "+-":
            self._state = "num_exp_sign"
        else:
            return False
        return True

    def _value_ended(self, events: list[JsonEvent], raw: str | None) -> None:
        events.append(JsonEvent("end", len(self._stack), raw))
        if self._stack:
            self._state = "after_value"
        else:
            self.done = True
            self._state = "done"


class JsonStringDecoder:
    """Decodes the body of a JSON string (the text between the quotes) incrementally.

    ``feed`` returns the decoded text that is certain; an escape cut in the middle, or a high surrogate
    waiting for its low half, is held back so a half escape is never emitted.
    """

    def __init__(self) -> None:
        self._pending = ""  # raw text of an unfinished escape sequence

    def feed(self, raw: str) -> str:
        text = self._pending + raw
        out: list[str] = []
        i = 0
        while i < len(text):
            ch = text[i]
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            if i + 1 >= len(text):
                break
            if text[i + 1] != "u":
                out.append(_SIMPLE_ESCAPES.get(text[i + 1], text[i + 1]))
                i += 2
                continue
            if i + 6 > len(text):
                break
            code = int(text[i + 2:i + 6], 16)
            if 0xD800 <= code < 0xDC00:  # a high surrogate: needs the following \uDC00-\uDFFF
                follows = text[i + 6:i + 8]
                if len(text) < i + 12 and "\\u".startswith(follows):
                    break  # its low half may still come
                low = int(text[i + 8:i + 12], 16) if follows == "\\u" else -1
                if 0xDC00 <= low < 0xE000:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    i += 12
                    continue
            # a lone surrogate cannot be encoded as UTF-8: replace it, as json.loads + encode would fail
            out.append("\ufffd" if 0xD800 <= code < 0xE000 else chr(code))
            i += 6
        self._pending = text[i:]
        return "".join(out)

    def flush(self) -> str:
        """At the closing quote: a held-back lone high surrogate becomes U+FFFD; a cut escape is dropped."""
        pending, self._pending = self._pending, ""
        return "\ufffd" if len(pending) == 6 and pending.startswith("\\u") else ""
