"""Streaming parse of one JSON call object, ``{"name": "...", "arguments": {...}}``, shared by the JSON formats.

The arguments are passed on as the exact raw text of the arguments object, character by character as each
one is validated, so the fragments joined are the whole object and nothing is ever taken back. Arguments
written before the name are held until the name is known (a call is never emitted without its name).
"""
from __future__ import annotations

import json
from typing import Iterable

from api.tool_calls.json_scan import JsonScanner


class JsonCallObjectParser:
    """Consumes the characters of one call object; the owner polls ``name`` and ``take_arguments()``.

    ``state`` is "open", "done" (the object closed) or "failed" (not a call object: the owner decides
    whether that text is content). ``arguments_keys`` name the member holding the arguments ("parameters"
    for Llama 3). With ``strict``, any other member, or a name outside ``known_names``, fails the parse:
    formats whose calls look like ordinary JSON content need that to tell the two apart.
    """

    def __init__(self, *, arguments_keys: Iterable[str] = ("arguments", "parameters"), strict: bool = False,
                 known_names: Iterable[str] | None = None) -> None:
        self.state = "open"
        self.name: str | None = None
        self._arguments_keys = frozenset(arguments_keys)
        self._strict = strict
        self._known_names = frozenset(known_names) if known_names is not None else None
        self._scanner = JsonScanner(capture_depth=1)
        self._key: str | None = None
        self._capturing = False  # inside the raw arguments object
        self._arguments_seen = False
        self._ready: list[str] = []  # argument text not yet taken by the owner

    def feed(self, text: str) -> int:
        """Consume characters from ``text`` until the object ends or fails; returns how many were consumed.

        The character that ends the object is consumed; a character that fails it is not.
        """
        for position, ch in enumerate(text):
            if self.state != "open":
                return position
            if not self._feed_char(ch):
                self.state = "failed"
                return position
            if self._scanner.done:
                if not self._arguments_seen:
                    self._ready.append("{}")  # a call without arguments: an empty arguments object
                self.state = "done" if self.name is not None else "failed"
                return position + 1
        return len(text)

    def take_arguments(self) -> str:
        """Argument text validated so far and not yet taken; empty until the name is known."""
        if self.name is None or not self._ready:
            return ""
        text = "".join(self._ready)
        self._ready.clear()
        return text

    def _feed_char(self, ch: str) -> bool:
        events = self._scanner.feed(ch)
        if events is None:
            return False
        if self._capturing:
            self._ready.append(ch)
        for event in events:
            if event.depth != 1:
                continue
            if event.kind == "key":
                self._key = json.loads(event.raw)
                if self._strict and self._key not in self._arguments_keys and self._key not in ("name", "type"):
                    return False
            elif event.kind == "start":
                if not self._member_started(ch):
                    return False
            elif event.kind == "end":
                if not self._member_ended(event.raw):
                    return False
        return True

    def _member_started(self, ch: str) -> bool:
        if self._key == "name":
            return ch == '"' and self.name is None
        if self._key in self._arguments_keys:
            if self._arguments_seen or ch not in '{"':
                return False  # arguments must be an object (or a JSON string holding one), given once
            self._arguments_seen = True
            if ch == "{":
                self._capturing = True
                self._ready.append(ch)
        return True

    def _member_ended(self, raw: str | None) -> bool:
        if self._key == "name":
            name = json.loads(raw)
            if not name or (self._known_names is not None and name not in self._known_names):
                return False
            self.name = name
        elif self._key in self._arguments_keys:
            if self._capturing:
                self._capturing = False
            elif raw is not None:
                # some models send the arguments as a string holding the JSON text; pass its content on
                self._ready.append(json.loads(raw).strip() or "{}")
        return True
