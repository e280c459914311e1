"""One chat turn, prepared: the rendered prompt, its token ids, the grammar on the reply and the reply's parser.

Every dialect (chat completions now; Responses and Messages translate into the same ``ChatTurn``) goes
through ``prepare_turn``: one template render, one tokenizer call (the replies this server generated kept as
their generated ids: api/prompt_ids.py), one grammar choice:

    tool_choice required / a named function  -> the format's tool-call grammar from the first token
    response_format json_object / json_schema -> that JSON grammar
    tool_choice auto                          -> free text, constrained once the format's trigger appears, or
                                                 a line opens a call as bare or fenced JSON (recovery)
                                                 (generic format: its JSON grammar from the first token)
    tool_choice none                          -> free text, no call parsed (generic format: text that
                                                 cannot begin its tool-call JSON)
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from api.chat_protocol import ChatProtocol
from api.errors import APIError, bad_request
from api.generic_tools import rewrite_history
from api.prompt_ids import PromptIds, encode_prompt
from api.tool_calls import OutputParser, create_output_parser, prompt_opens_reasoning
from api.tool_calls.recovered_call import answered_calls, recovery_trigger, restatement_stops
from api.tool_specs import ToolSpecs
from engine.grammar import GrammarError, TokenConstraint, json_object_grammar, json_schema_grammar
from engine.loader import encode_chat_prompt

log = logging.getLogger("strata.api")


@dataclass
class ChatTurn:
    """A chat request as every dialect hands it in: template messages, tools, reply format, template variables."""

    messages: list[dict[str, Any]]
    specs: ToolSpecs
    response_format: dict[str, Any] | None = None  # OpenAI's shape: {"type": "json_schema", "json_schema": {...}}
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    conversation_key: str | None = None  # the client's name for the conversation (prompt_cache_key, session id)


@dataclass
class PreparedTurn:
    """What the engine and the reply writer need: prompt ids, the constraint, how to parse the reply."""

    prompt_text: str
    prompt_ids: list[int]
    constraint: TokenConstraint | None
    protocol: ChatProtocol
    parses_tools: bool
    starts_in_reasoning: bool
    tools: list[dict[str, Any]]
    custom_tool_names: frozenset[str] = frozenset()
    recovers_calls: bool = False  # calls written as bare or fenced JSON are recovered (tool_choice auto)
    answered_calls: frozenset[tuple[str, str]] = frozenset()  # the calls whose tool results end the prompt
    extra_stops: tuple[str, ...] = ()  # stop sequences the server adds (a call restated a second time)
    encoded: PromptIds | None = None  # the ids with the replies they keep as generated (api/prompt_ids.py)

    def create_parser(self, on_recovered: Callable[[str], None] | None = None) -> OutputParser:
        owns_reasoning = self.protocol.tool_format.owns_reasoning  # harmony: every reply is channel markup
        fmt = self.protocol.tool_format if self.parses_tools or owns_reasoning else None
        return create_output_parser(fmt, self.tools if self.parses_tools else None,
                                    reasoning=self.protocol.reasoning if self.protocol.reasoning_field else None,
                                    starts_in_reasoning=self.starts_in_reasoning,
                                    recover_calls=self.recovers_calls, on_recovered=on_recovered,
                                    answered_calls=self.answered_calls)


def render_turn(state, turn: ChatTurn) -> str:
    """The prompt text of a turn; template errors are 400s naming the template."""
    protocol: ChatProtocol = state.protocol
    fmt, specs = protocol.tool_format, turn.specs
    messages, tools = turn.messages, specs.tools or None
    if specs.tools and not fmt.renders_in_template:
        system = fmt.system_prompt(specs.tools)
        messages, tools = rewrite_history(messages, system or "", json_answers=fmt.json_answers), None
    kwargs = dict(turn.template_kwargs)
    try:
        return state.loaded.chat_template.render(messages, tools=tools, add_generation_prompt=turn.add_generation_prompt,
                                                 **kwargs)
    except ValueError as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from exc


def recovers_calls(protocol: ChatProtocol, turn: ChatTurn) -> bool:
    """Whether this turn's reply may hold calls written as JSON objects, to be recovered: tool_choice auto, no
    response_format (whose JSON answers must stay answers), a format whose models do that, recovery on."""
    specs = turn.specs
    return (protocol.recovers_calls and specs.calls_possible and specs.mode == "auto"
            and _answer_format_grammar(turn.response_format) is None)


def _reply_grammar(protocol: ChatProtocol, turn: ChatTurn) -> tuple[str | None, str | None, str]:
    """(grammar text, lazy trigger, the request field it answers for) or (None, None, "")."""
    fmt, specs = protocol.tool_format, turn.specs
    if specs.calls_possible and specs.mode == "required":
        grammar = fmt.grammar(specs.tools, required=True, forced_name=specs.forced_name,
                              allow_parallel=_parallel(fmt, specs), special_token_ids=protocol.special_token_ids)
        return grammar, None, "tool_choice"
    answer = _answer_format_grammar(turn.response_format)
    if answer is not None and specs.calls_possible:  # tool_choice auto: a call, or the answer in its format
        calls = fmt.grammar(specs.tools, required=True, forced_name=None, allow_parallel=_parallel(fmt, specs),
                            special_token_ids=protocol.special_token_ids)
        return _either(calls, answer), None, "response_format"
    if answer is not None:
        return answer, None, "response_format"
    if specs.calls_possible:
        grammar = fmt.grammar(specs.tools, required=False, forced_name=None, allow_parallel=_parallel(fmt, specs),
                              special_token_ids=protocol.special_token_ids)
        return grammar, fmt.lazy_trigger, "tools"
    if specs.tools and not fmt.renders_in_template:  # the system prompt offers tools, tool_choice forbids them
        return fmt.answer_only_grammar(), None, "tool_choice"
    return None, None, ""


def _parallel(fmt, specs: ToolSpecs) -> bool:
    """parallel_tool_calls as the request set it, else the format's default."""
    return fmt.parallel_by_default if specs.allow_parallel is None else specs.allow_parallel


def _answer_format_grammar(response_format: dict | None) -> str | None:
    kind = (response_format or {}).get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        return json_schema_grammar(spec.get("schema") or {}, strict=bool(spec.get("strict", True)))
    if kind == "json_object":
        return json_object_grammar()
    return None


def _either(calls: str, answer: str) -> str:
    """One grammar that accepts what `calls` accepts or what `answer` accepts: each one's start rule is
    renamed, the rest of its text kept (the call grammar's rule names never start with "answer_")."""
    def body(text: str, name: str) -> str:
        head, _, rest = text.partition("\n")
        assert head.startswith("start:"), head
        return f"{name}:{head[len('start:'):]}\n{rest}"
    return f"start: tool_calls | answer_json\n{body(calls, 'tool_calls')}{body(answer, 'answer_json')}"


def build_constraint(protocol: ChatProtocol, turn: ChatTurn) -> TokenConstraint | None:
    """The grammar on the reply, compiled; a grammar llguidance cannot compile is a 400 naming the field."""
    grammar, trigger, param = _reply_grammar(protocol, turn)
    if grammar is None:
        return None
    triggers = ()
    if trigger is not None and recovers_calls(protocol, turn):
        answered_names = frozenset(name for name, _ in answered_calls(turn.messages))
        triggers = (recovery_trigger(turn.specs.tools, answered_names),)
    try:
        return protocol.grammar.constraint(grammar, lazy_trigger=trigger, triggers=triggers)
    except GrammarError as exc:
        raise bad_request(f"{param}: the grammar for this request does not compile: {exc}", param=param) from exc


def generation_prompt(state, turn: ChatTurn, text: str) -> str:
    """The text the template ends a prompt with to ask for a reply (``<|im_start|>assistant\n``): `text`
    (the turn rendered) against the turn rendered with add_generation_prompt flipped. "" when the template
    does not append it (a template that renders the two alike, or fails on one)."""
    flipped = dataclasses.replace(turn, add_generation_prompt=not turn.add_generation_prompt)
    try:
        other = render_turn(state, flipped)
    except APIError:
        return ""
    asking, plain = (text, other) if turn.add_generation_prompt else (other, text)
    return asking[len(plain):] if asking.startswith(plain) else ""


def encode_turn(state, turn: ChatTurn, text: str, salt: str) -> PromptIds:
    """The rendered turn's ids, the replies this server generated kept as generated (api/prompt_ids.py)
    when --keep-reply-tokens is on and it holds any for this salt."""
    memory = state.replies
    if memory is None or not memory.holds_salt(salt):
        return PromptIds(encode_chat_prompt(state.loaded.tokenizer, text))
    return encode_prompt(state.loaded.tokenizer, text, generation_prompt(state, turn, text), memory, salt)


def prepare_turn(state, turn: ChatTurn, salt: str = "") -> PreparedTurn:
    """Render, tokenize, and choose the grammar and parser of one chat turn (`salt`: the cache salt, whose
    generated replies the prompt may keep). Raises APIError."""
    protocol: ChatProtocol = state.protocol
    text = render_turn(state, turn)
    encoded = encode_turn(state, turn, text, salt)
    prompt_ids = encoded.ids
    constraint = build_constraint(protocol, turn)
    specs = turn.specs
    parses_tools = specs.calls_possible
    reasoning = protocol.reasoning
    starts_in_reasoning = reasoning is not None and prompt_opens_reasoning(text, reasoning)
    return PreparedTurn(text, prompt_ids, constraint, protocol, parses_tools, starts_in_reasoning, specs.tools,
                        specs.custom_names, recovers_calls(protocol, turn), answered_calls(turn.messages),
                        restatement_stops(turn.messages) if recovers_calls(protocol, turn) else (), encoded)
