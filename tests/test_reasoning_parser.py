"""Reasoning split: ``<think>...</think>`` to ParsedDelta.reasoning, the rest to content / the tool-call parser.

Every case is fed whole, one character at a time and in random splits; all must give the same result.
"""
from __future__ import annotations

import json
import random

import pytest

from api.tool_calls import ReasoningTags, create_output_parser, detect_reasoning, get_format, prompt_opens_reasoning

TAGS = ReasoningTags()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _splits(text: str) -> list[list[str]]:
    out = [[text], list(text)]
    for seed in range(6):
        rng, pieces, start = random.Random(seed), [], 0
        while start < len(text):
            end = start + rng.randint(1, 6)
            pieces.append(text[start:end])
            start = end
        out.append(pieces)
    return out


def _parse(text: str, *, starts_in_reasoning: bool, fmt: str | None = None):
    """(reasoning, content, calls) for every split of ``text``, checked to agree."""
    results = []
    for pieces in _splits(text):
        parser = create_output_parser(get_format(fmt) if fmt else None, TOOLS if fmt else None,
                                      reasoning=TAGS, starts_in_reasoning=starts_in_reasoning)
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        calls: list[list[str]] = []
        for delta in deltas:
            for call in delta.tool_calls:
                if call.name is not None:
                    calls.append([call.name, ""])
                calls[call.index][1] += call.arguments
        assert parser.num_tool_calls == len(calls)
        results.append(("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), calls))
    assert all(result == results[0] for result in results)
    return results[0]


@pytest.mark.parametrize("text,starts_in_reasoning,reasoning,content", [
    ("<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nThe answer is 4.", False,
     "The user wants 2+2.\nThat is 4.", "The answer is 4."),
    ("\n<think>short</think>answer", False, "short", "answer"),
    ("The prompt opened the block.\n</think>\n\nAnswer: yes", True, "The prompt opened the block.", "Answer: yes"),
    ("<think>\nrepeated opening tag\n</think>\nok", True, "repeated opening tag", "ok"),  # DeepSeek-R1 habit
    ("</think>\n\nNo reasoning at all.", True, "", "No reasoning at all."),
    ("Plain reply, with <think> later on </think> as text.", False, "",
     "Plain reply, with <think> later on </think> as text."),
    ("<thinking> is not the tag", False, "", "<thinking> is not the tag"),
    ("  \n", False, "", "  \n"),
    ("Unicode 思考 🚀 with a </thi", True, "Unicode 思考 🚀 with a", ""),  # cut off inside the closing tag
    ("<think>\nstill thinking when max_tokens hit", False, "still thinking when max_tokens hit", ""),
])
def test_reasoning_split(text: str, starts_in_reasoning: bool, reasoning: str, content: str) -> None:
    assert _parse(text, starts_in_reasoning=starts_in_reasoning) == (reasoning, content, [])


def test_no_tags_is_all_content() -> None:
    text = "Paris is the capital of France.\n\nIt has 2.1 million inhabitants."
    assert _parse(text, starts_in_reasoning=False) == ("", text, [])


def test_reasoning_then_tool_call() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "<think>\nI need the weather. Maybe <tool_call> later.\n</think>\n\nLet me check.\n" + call
    reasoning, content, calls = _parse(text, starts_in_reasoning=False, fmt="hermes")
    assert reasoning == "I need the weather. Maybe <tool_call> later."  # markup in reasoning is reasoning
    assert content == "Let me check.\n"
    assert calls == [["get_weather", '{"city": "Paris"}']]
    assert json.loads(calls[0][1]) == {"city": "Paris"}


def test_starts_in_reasoning_with_qwen3_coder_call() -> None:
    text = ("weather needed\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
            "</parameter>\n</function>\n</tool_call>")
    assert _parse(text, starts_in_reasoning=True, fmt="qwen3_coder") == (
        "weather needed", "", [["get_weather", '{"city": "Oslo"}']])


def test_reasoning_streams_promptly() -> None:
    parser = create_output_parser(None, None, reasoning=TAGS, starts_in_reasoning=False)
    assert parser.feed("<thi").is_empty
    first = parser.feed("nk>\nStep one. ")
    assert (first.reasoning, first.content) == ("Step one.", "")  # the trailing space waits: it may end the block
    second = parser.feed("Step two.</think>\n\nDone")
    assert (second.reasoning, second.content) == (" Step two.", "Done")


def test_detect_reasoning_and_prompt_opening() -> None:
    qwen3 = "{%- if enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{{ m.reasoning_content }}</think>"
    assert detect_reasoning(qwen3) == ReasoningTags("<think>", "</think>")
    assert detect_reasoning("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", TAGS)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", TAGS)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", TAGS)
