"""The registry of tool-call formats, picking one from a chat template, and assembling a reply's parser."""
from __future__ import annotations

from typing import Callable

from api.tool_calls.base import OutputParser, PlainContentParser, ToolFormat, function_specs
from api.tool_calls.generic import GenericFormat, GenericJsonFormat
from api.tool_calls.harmony import CHANNEL as HARMONY_CHANNEL
from api.tool_calls.harmony import HarmonyFormat
from api.tool_calls.hermes import HermesFormat
from api.tool_calls.llama3_json import Llama3JsonFormat
from api.tool_calls.mistral import MistralFormat
from api.tool_calls.qwen3_coder import Qwen3CoderFormat
from api.tool_calls.reasoning import ReasoningSplitter, ReasoningTags
from api.tool_calls.recovery import RecoveringParser

FORMATS: dict[str, ToolFormat] = {
    fmt.name: fmt
    for fmt in (HermesFormat(), Qwen3CoderFormat(), Llama3JsonFormat(), MistralFormat(), GenericFormat(),
                GenericJsonFormat(), HarmonyFormat())
}

_LLAMA3_MARKERS = ("<|python_tag|>", "<|start_header_id|>")


def get_format(name: str) -> ToolFormat:
    """The format registered as ``name``; ValueError naming the known formats otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(f"unknown tool-call format {name!r}; known formats: {known}") from None


def detect_format(template_source: str) -> ToolFormat:
    """Pick the format from the Jinja chat-template text.

    A template that never mentions ``tools`` cannot render them: "generic" (the server prompts for the
    format itself). Otherwise, by the markup the template teaches, checked in this order: ``<function=``
    -> qwen3_coder (its template also has ``<tool_call>``), ``<tool_call>`` -> hermes, ``[TOOL_CALLS]`` ->
    mistral, ``<|python_tag|>`` or Llama 3 header tokens -> llama3_json. A template that renders tools but
    matches none of these falls back to hermes, the format most open models are fine-tuned on. A template
    that writes harmony channels (``<|channel|>``, gpt-oss) is harmony whether or not it renders tools: its
    replies are channel messages even without them.
    """
    if HARMONY_CHANNEL in template_source:
        return FORMATS["harmony"]
    if "tools" not in template_source:
        return FORMATS["generic"]
    if "<function=" in template_source:
        return FORMATS["qwen3_coder"]
    if "<tool_call>" in template_source:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template_source:
        return FORMATS["mistral"]
    if any(marker in template_source for marker in _LLAMA3_MARKERS):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def create_output_parser(fmt: ToolFormat | None, tools: list[dict] | None, *, reasoning: ReasoningTags | None,
                         starts_in_reasoning: bool, recover_calls: bool = False,
                         on_recovered: Callable[[str], None] | None = None,
                         answered_calls: frozenset[tuple[str, str]] = frozenset()) -> OutputParser:
    """The parser for one reply: reasoning split off first, then ``fmt``'s tool calls in what remains.

    Without a format or without function tools the reply is plain content (after the reasoning split). A
    format that ``owns_reasoning`` (harmony) parses every reply itself and is never wrapped. With
    ``recover_calls`` (and a format that ``recovers_json_calls``), calls written as JSON objects outside the
    format's markup are recovered too; ``on_recovered(shape)`` hears of each; restating one of
    ``answered_calls`` (the calls whose results end the prompt) is content.
    """
    if fmt is not None and fmt.owns_reasoning:
        return fmt.create_parser(list(tools or []))
    inner: OutputParser
    if fmt is not None and function_specs(tools):
        inner = fmt.create_parser(list(tools or []))
        if recover_calls and fmt.recovers_json_calls:
            inner = RecoveringParser(inner, list(tools or []), on_recovered, answered_calls)
    else:
        inner = PlainContentParser()
    if reasoning is None:
        return inner
    return ReasoningSplitter(inner, reasoning, starts_in_reasoning=starts_in_reasoning)
