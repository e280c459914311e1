"""The hand-written streaming JSON scanner (api/tool_calls/json_scan.py) against pydantic_core.from_json.

The scanner is kept (a per-character scanner beats re-parsing on every token, and libraries' partial modes
lose end positions); these properties tie it to a well-kept parser on complete documents: it accepts exactly
the texts from_json accepts, reports the top-level keys from_json finds, and its string decoder gives the
strings from_json decodes, however the text is cut into pieces.
"""
from __future__ import annotations

import json
import re

import pydantic_core
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from api.tool_calls.json_scan import JsonScanner, JsonStringDecoder

_WHITESPACE = " \t\n\r"
# Lone surrogates are left out: from_json refuses them and the scanner, as a validator of what clients
# parse leniently, does not look inside \u escapes (JsonStringDecoder replaces them with U+FFFD).
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_SCALARS = (st.none() | st.booleans() | st.integers(-10**20, 10**20) | _TEXT
            | st.floats(allow_nan=False, allow_infinity=False))
JSON_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(_TEXT, inner, max_size=4), max_leaves=12)
# Texts near JSON: its structural characters, literals' letters, digits, escapes, a few others.
_NEAR_JSON = st.text(st.sampled_from(list('{}[]",:.-+eE0123456789 \n\\/utrfalsn\x01x')), max_size=24)


def render(value, indent: int | None, ensure_ascii: bool) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def scan(text: str) -> tuple[bool, list]:
    """(whether the scanner takes ``text`` as one complete JSON document, its events). A number ends only
    at the character after it, so a space is fed after the text; what follows the value must be
    whitespace."""
    scanner, events = JsonScanner(capture_depth=1), []
    for i, ch in enumerate(text + " "):
        if scanner.done:
            return text[i:].strip(_WHITESPACE) == "", events
        found = scanner.feed(ch)
        if found is None:
            return False, events
        events += found
    return scanner.done, events


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def from_json_accepts(text: str) -> bool:
    try:
        pydantic_core.from_json(text, allow_inf_nan=False)
    except ValueError:
        # a lone surrogate escape: from_json refuses it, the scanner takes it (see _TEXT); not compared
        assume(_SURROGATE_ESCAPE.search(text) is None)
        return False
    return True


@settings(max_examples=150, deadline=None)
@given(JSON_VALUES, st.sampled_from([None, 0, 2]), st.booleans(), st.sampled_from(["", " ", "\n\t"]))
def test_every_document_from_json_parses_is_accepted_whole(value, indent, ensure_ascii, pad):
    text = pad + render(value, indent, ensure_ascii) + pad
    assert from_json_accepts(text)
    accepted, events = scan(text)
    assert accepted
    assert [e.kind for e in events if e.depth == 0] == ["start", "end"]  # one top-level value, its end seen


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(_TEXT, JSON_VALUES, max_size=5), st.booleans())
def test_top_level_keys_are_the_keys_from_json_finds(value, ensure_ascii):
    text = render(value, None, ensure_ascii)
    _, events = scan(text)
    keys = [pydantic_core.from_json(e.raw) for e in events if e.kind == "key" and e.depth == 1]
    assert keys == list(pydantic_core.from_json(text))


@settings(max_examples=300, deadline=None)
@given(_NEAR_JSON)
def test_near_json_text_is_accepted_exactly_when_from_json_accepts_it(text):
    assert scan(text)[0] == from_json_accepts(text)


@settings(max_examples=150, deadline=None)
@given(JSON_VALUES, st.data())
def test_a_document_with_one_character_changed_is_judged_as_from_json_judges_it(value, data):
    text = render(value, None, True)
    at = data.draw(st.integers(0, len(text) - 1))
    changed = text[:at] + data.draw(st.sampled_from(list('{}[]",:0e-. x\\'))) + text[at + 1:]
    assert scan(changed)[0] == from_json_accepts(changed)


@settings(max_examples=300, deadline=None)
@given(_TEXT, st.booleans(), st.data())
def test_string_decoder_gives_what_from_json_decodes_in_any_pieces(value, ensure_ascii, data):
    body = json.dumps(value, ensure_ascii=ensure_ascii)[1:-1]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(body)), max_size=4)))
    decoder = JsonStringDecoder()
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    decoded = "".join(decoder.feed(piece) for piece in pieces) + decoder.flush()
    assert decoded == pydantic_core.from_json('"' + body + '"')
