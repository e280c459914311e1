"""Streaming a tool-call parser as a client receives it (the texts split whole, per character and at random),
the deltas joined under the OpenAI delta rules, and texts as byte-level token ids with special tokens: shared
by tests/test_tool_formats.py and test_harmony.py."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

from api.tool_calls import ParsedDelta

TOOLS = json.loads((Path(__file__).parents[1] / "data" / "tool_outputs" / "tools.json").read_text(encoding="utf-8"))
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


def split_whole(text: str) -> list[str]:
    return [text]


def split_chars(text: str) -> list[str]:
    return list(text)


def split_random(seed: int):
    def split(text: str) -> list[str]:
        rng, pieces, start = random.Random(seed), [], 0
        while start < len(text):
            end = start + rng.randint(1, 9)
            pieces.append(text[start:end])
            start = end
        return pieces
    return split


SPLITS = [split_whole, split_chars] + [split_random(seed) for seed in range(6)]


def feed(parser, pieces: list[str]) -> list[ParsedDelta]:
    """The parser's delta for each piece, then its finish()."""
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return deltas


def joined(deltas: list[ParsedDelta]) -> tuple[str, str, list[dict]]:
    """Content, reasoning and calls as a client assembles them, checking the OpenAI delta rules on the way."""
    calls: list[dict] = []
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index == len(calls):  # a new call: its first delta carries id and name
                assert call.id and CALL_ID.fullmatch(call.id) and call.name, call
                calls.append({"id": call.id, "name": call.name, "arguments": call.arguments})
            else:
                assert call.index == len(calls) - 1, "fragments must belong to the latest call"
                assert call.id is None and call.name is None, call
                calls[-1]["arguments"] += call.arguments
    assert len({call["id"] for call in calls}) == len(calls)
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), calls


def byte_tokens(text: str, specials: dict[str, int]) -> list[int]:
    """`text` as one id per byte, each of `specials` (text -> id) as its one id."""
    pattern = "(" + "|".join(re.escape(token) for token in specials) + ")" if specials else None
    out: list[int] = []
    for piece in re.split(pattern, text) if pattern else [text]:
        out += [specials[piece]] if piece in specials else list(piece.encode())
    return out
