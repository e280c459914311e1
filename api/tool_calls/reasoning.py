"""Reasoning ("thinking") text: ``<think>...</think>`` split from the reply before tool calls are looked for.

Qwen3 writes ``<think>`` itself at the start of the reply; DeepSeek-R1 style templates (and Qwen3 thinking
templates) open it in the prompt, so the reply starts inside the reasoning (``starts_in_reasoning``).
Only a ``<think>`` at the very start of the reply counts; later it is ordinary content. Whitespace around
the reasoning (the newlines models put after ``<think>`` and after ``</think>``) is markup, not text.
"""
from __future__ import annotations

from api.tool_calls.base import OutputParser, ParsedDelta, ReasoningTags
from api.tool_calls.stream_base import partial_marker_length

_WHITESPACE = " \t\n\r"


def detect_reasoning(template_source: str) -> ReasoningTags | None:
    """``<think>``/``</think>`` tags when the chat template uses them (Qwen3, DeepSeek-R1 and their distills)."""
    tags = ReasoningTags()
    if tags.start in template_source and tags.end in template_source:
        return tags
    return None


def prompt_opens_reasoning(prompt: str, tags: ReasoningTags) -> bool:
    """True when the rendered prompt ends inside an opened reasoning block (the reply starts in reasoning)."""
    return prompt.rstrip(_WHITESPACE).endswith(tags.start)


class ReasoningSplitter:
    """Wraps the reply's parser: reasoning text goes to ``reasoning``, the rest is fed to ``inner``.

    States: "start" (a ``<think>`` may open) -> "reasoning" -> "after" (whitespace after ``</think>``)
    -> "content" (everything goes to ``inner``).
    """

    def __init__(self, inner: OutputParser, tags: ReasoningTags, *, starts_in_reasoning: bool) -> None:
        self._inner = inner
        self._tags = tags
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._reasoning_began = False
        self._pending = ""

    @property
    def num_tool_calls(self) -> int:
        return self._inner.num_tool_calls

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        out = self._run(final=True)
        out.extend(self._inner.finish())
        return out

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final):
            pass
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        if self._state == "content":
            if self._pending:
                out.extend(self._inner.feed(self._pending))
                self._pending = ""
            return False
        body = self._pending.lstrip(_WHITESPACE)
        if self._state == "start":
            if body.startswith(self._tags.start):
                self._pending, self._state = body[len(self._tags.start):], "reasoning"
                return True
            if not final and self._tags.start.startswith(body):
                return False  # empty, or the opening tag still arriving
            self._state = "content"  # no reasoning: the text, with its leading whitespace, is content
            return True
        if self._state == "after":
            self._pending = body
            if body:
                self._state = "content"
            return bool(body)
        return self._in_reasoning(out, final)

    def _in_reasoning(self, out: ParsedDelta, final: bool) -> bool:
        if not self._reasoning_began:
            # drop the whitespace after the opening tag, and a repeated opening tag some models write
            body = self._pending.lstrip(_WHITESPACE)
            if body.startswith(self._tags.start):
                self._pending = body[len(self._tags.start):]
                return True
            if not body or (not final and self._tags.start.startswith(body)):
                self._pending = body
                return False
            self._pending, self._reasoning_began = body, True
        pending = self._pending
        position = pending.find(self._tags.end)
        if position >= 0:
            out.reasoning += pending[:position].rstrip(_WHITESPACE)
            self._pending = pending[position + len(self._tags.end):]
            self._state = "after"
            return True
        hold = partial_marker_length(pending, (self._tags.end,))
        text = pending[:len(pending) - hold]
        certain = text.rstrip(_WHITESPACE)  # trailing whitespace may be the markup before the closing tag
        out.reasoning += certain
        self._pending = "" if final else pending[len(certain):]
        return False
