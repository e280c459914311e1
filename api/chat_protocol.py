"""What the served model speaks beyond plain text: its tool-call format, its reasoning tags, its grammar compiler.

Decided once per model at start (from the chat template, or --tool-call-format / --reasoning-format) and
logged once, so an operator can tell from the start-up log which format a model got and whether the server
writes the tool list into the system prompt itself (the generic format, for templates that ignore
``tools``).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from api.tool_calls import ReasoningTags, ToolFormat, detect_format, detect_reasoning, get_format
from engine.chat_template import ChatTemplate
from engine.grammar import GrammarCompiler
from engine.tokenizer import Tokenizer

log = logging.getLogger("strata.api")


@dataclass
class ChatProtocol:
    """The served model's tool-call format and reasoning tags, and its grammar compiler (built on first use:
    a large vocabulary takes a moment, and most requests never need a grammar)."""

    tool_format: ToolFormat
    reasoning: ReasoningTags | None
    reasoning_field: str | None  # "reasoning_content" | "reasoning"; None: reasoning stays in content
    tokenizer: Tokenizer
    special_token_ids: dict[str, int] = field(default_factory=dict)  # control-token text -> id, for grammars
    recovers_calls: bool = False  # --tool-call-recovery on and the format's models write JSON calls
    _compiler: GrammarCompiler | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _recovered_shapes: set[str] = field(default_factory=set)

    def note_recovered(self, shape: str) -> None:
        """Log the first recovered call of each shape ("fenced", "bare", "... function-wrapper") once."""
        with self._lock:
            if shape in self._recovered_shapes:
                return
            self._recovered_shapes.add(shape)
        what = {"fenced": "a fenced JSON block", "bare": "bare JSON"}[shape.split()[0]]
        spelling = ' in the old "function": {...} spelling' if shape.endswith("function-wrapper") else ""
        log.info("tool calls: the model wrote a tool call as %s%s instead of the %s format's markup; recovered "
                 "(--tool-call-recovery off turns this off; logged once per shape)", what, spelling,
                 self.tool_format.name, extra={"fields": {"tool_call_recovered": shape}})

    @property
    def hidden_token_ids(self) -> frozenset[int]:
        """Control tokens left out of a reply's text: all but the format's markup and the reasoning tags (the
        parsers read those). A model that writes ``<|im_start|>`` mid-reply then shows no such text, as with
        llama-server, whose replies keep only a format's "preserved tokens"."""
        shown = set(self.tool_format.markers)
        if self.reasoning is not None:
            shown.update((self.reasoning.start, self.reasoning.end))
        return frozenset(i for text, i in self.special_token_ids.items() if text not in shown)

    @property
    def grammar(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer)
            return self._compiler


def create_chat_protocol(template: ChatTemplate, tokenizer: Tokenizer, tool_call_format: str = "auto",
                         reasoning_format: str = "reasoning_content", tool_call_recovery: str = "on") -> ChatProtocol:
    """Pick the tool-call format and reasoning tags for a model and log the choice once."""
    if tool_call_format == "auto":
        fmt, how = detect_format(template.template), "picked from the chat template"
    else:
        fmt, how = get_format(tool_call_format), "set by --tool-call-format"
    reasoning = detect_reasoning(template.template) if reasoning_format != "none" else None
    owns_reasoning = fmt.owns_reasoning and reasoning_format != "none"  # harmony's analysis channel
    field_name = reasoning_format if reasoning is not None or owns_reasoning else None
    if fmt.renders_in_template and "tools" not in template.template:
        log.warning("tool calls: format %s (%s), but the chat template (%s) never renders tools: tool definitions "
                    "will not reach the model; use --tool-call-format generic or a --chat-template that renders "
                    "them", fmt.name, how, template.source, extra={"fields": {"tool_call_format": fmt.name}})
    elif fmt.renders_in_template:
        log.info("tool calls: format %s (%s, template %s)", fmt.name, how, template.source,
                 extra={"fields": {"tool_call_format": fmt.name}})
    else:
        log.info("tool calls: format %s (%s, template %s): the chat template does not render tools, so the "
                 "server writes the tool list and the answer format into the system prompt itself, and a grammar "
                 "keeps replies in that format", fmt.name, how, template.source,
                 extra={"fields": {"tool_call_format": fmt.name}})
    if reasoning is not None:
        log.info("reasoning: %s...%s text goes to message.%s", reasoning.start, reasoning.end, field_name,
                 extra={"fields": {"reasoning_field": field_name}})
    elif owns_reasoning:
        log.info("reasoning: the %s format's reasoning goes to message.%s", fmt.name, field_name,
                 extra={"fields": {"reasoning_field": field_name}})
    # llguidance matches a control token only by id (<[id]>), never by its text: markers such as Mistral's
    # [TOOL_CALLS] must be written that way in the format's grammar.
    specials = {tokenizer.id_to_token(i): i for i in sorted(tokenizer.special_ids)}
    recovers = tool_call_recovery == "on" and fmt.recovers_json_calls
    if recovers:
        log.info("tool calls: calls the model writes as bare or fenced JSON naming a declared tool are recovered "
                 "(--tool-call-recovery off: only the %s markup counts)", fmt.name)
    protocol = ChatProtocol(fmt, reasoning, field_name, tokenizer, specials, recovers)
    protocol.grammar.prepare()  # 0.15 s (49K vocab) to 0.7 s (152K) holding the GIL: at start, not in a request
    return protocol
