"""Running one prepared chat turn through the engine, the same way for every dialect.

A dialect (chat completions, Responses, Messages) parses its body into a ``ChatTurn``, then calls
``start_chat_turn``: one render and tokenizer call (``prepare_turn``), the reply budget clamped to the
context, the cache salt, the engine request with its grammar, and a ``ReplyAssembler`` that parses the reply.
The dialect only translates the assembler's deltas into its own events or whole body.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Mapping

from starlette.requests import Request as HTTPRequest

from api.branch_hints import branch_hints, content_guesses
from api.checkpoint_hints import line_starts
from api.chat_output import ReplyAssembler
from api.chat_turn import ChatTurn, PreparedTurn, encode_turn, prepare_turn, render_turn
from api.errors import APIError, bad_request, context_overflow, not_found_model, overloaded
from api.reply_recording import note_kept_replies, remember_reply
from api.reply_stream import ReplyEvent, reply_events
from api.tenancy import cache_salt_for
from engine.sampling import SamplingParams
from scheduler.engine_loop import QueueFullError, ShuttingDownError
from scheduler.request import Delta, Request

log = logging.getLogger("strata.api")
RETRY_AFTER_S = 2
CONVERSATION_HEADERS = ("x-smg-routing-key", "x-conversation-id")  # lower case: HTTP names ignore case


@dataclass
class TurnRun:
    """A submitted turn: the engine request, its reply's events (api/reply_stream.py), the prepared prompt,
    the reply's parser."""

    request: Request
    events: AsyncIterator[ReplyEvent]
    prepared: PreparedTurn
    assembler: ReplyAssembler


def fit_max_tokens(state, prompt_len: int, requested: int | None) -> int:
    """The reply's token budget: what the client asked for, clamped (with a log line) to the room the
    context leaves, as llama-server and Ollama do; only a prompt that leaves no room at all is a 400
    (code context_length_exceeded)."""
    room = state.ctx_size - prompt_len
    if room < 1:
        raise context_overflow(prompt_len, requested or 1, state.ctx_size)
    if requested is None:  # --default-max-tokens, clamped without a log line (its 0: all the room there is)
        return min(room, state.config.default_max_tokens or room)
    if requested > room:
        log.info("max_tokens %d is more than the %d tokens the context leaves after a %d-token prompt; "
                 "clamped to %d", requested, room, prompt_len, room,
                 extra={"fields": {"requested_max_tokens": requested, "max_tokens": room}})
        return room
    return requested


def submit(state, request: Request) -> AsyncIterator[Delta]:
    """Queue a request on the engine; a full queue or a stopping server is a 503 with Retry-After."""
    try:
        return state.engine.submit(request)
    except (QueueFullError, ShuttingDownError) as exc:
        raise overloaded(RETRY_AFTER_S, str(exc)) from exc


def start_chat_turn(state, http_request: HTTPRequest, request_id: str, turn: ChatTurn, *,
                    requested_max_tokens: int | None, make_params: Callable[[int], SamplingParams],
                    client_salt: str | None = None, top_logprobs: int | None = None,
                    num_tools: int | None = None) -> TurnRun:
    """Prepare, budget and submit one chat turn. ``make_params(max_tokens)`` builds the dialect's sampling
    settings once the budget is known. Raises APIError (400 for the prompt, 503 when the queue is full)."""
    salt = cache_salt_for(state.config, http_request.headers.get("authorization", ""), client_salt)
    prepared = prepare_turn(state, turn, salt)
    if not prepared.prompt_ids:
        raise bad_request("the prompt is empty after tokenization", param="messages")
    params = make_params(fit_max_tokens(state, len(prepared.prompt_ids), requested_max_tokens))
    if prepared.extra_stops:
        params = dataclasses.replace(params, stop=params.stop + prepared.extra_stops)
    if state.replies is not None:
        note_kept_replies(state.replies, request_id, prepared.encoded)
    request = Request(request_id, prepared.prompt_ids, params, top_logprobs=top_logprobs, cache_salt=salt,
                      describe_position=position_describer(state, turn, salt), constraint=prepared.constraint,
                      num_tools=len(turn.specs.tools) if num_tools is None else num_tools,
                      conversation_key=conversation_name(turn.conversation_key, http_request.headers),
                      earlier_turns=sum(m.get("role") == "assistant" for m in turn.messages),
                      checkpoint_positions=branch_hints(prepared.prompt_ids, state.message_start_id, state.line_end_ids),
                      checkpoint_guesses=content_guesses(prepared.prompt_ids, state.message_start_id, state.line_end_ids),
                      line_starts=line_starts(prepared.prompt_ids, state.line_end_ids))
    stream = submit(state, request)
    if state.replies is not None and turn.add_generation_prompt:
        stream = remember_reply(state.replies, state.loaded.tokenizer, stream, request, salt, prepared.prompt_text,
                                len(turn.messages), state.protocol.hidden_token_ids)
    def on_recovered(shape: str) -> None:
        state.protocol.note_recovered(shape)
        state.metrics.tool_calls_recovered.labels(shape=shape).inc()

    return TurnRun(request, reply_events(request, stream), prepared,
                   ReplyAssembler(prepared.create_parser(on_recovered), state.protocol.reasoning_field))


def conversation_name(body_key: str | None, headers: Mapping[str, str]) -> str | None:
    """The name a turn's conversation goes by in the logs and /cache: the body's (``prompt_cache_key``, Claude
    Code's session id), else the routing key a router forwards (SGLang's ``X-SMG-Routing-Key``, the one
    header it passes on, and which it drops ``prompt_cache_key`` from Responses bodies in favour of), else
    ``X-Conversation-Id``."""
    return body_key or next((headers[h] for h in CONVERSATION_HEADERS if headers.get(h)), None)


def position_describer(state, turn: ChatTurn, salt: str = "") -> Callable[[int], str]:
    """token position -> which message it falls in, for the log line that explains a cache miss.

    Renders growing prefixes of the conversation only when asked (a miss), never on the hot path."""
    def describe(position: int) -> str:
        messages = turn.messages
        for count in range(1, len(messages) + 1):
            head = ChatTurn(messages[:count], turn.specs, template_kwargs=turn.template_kwargs,
                            add_generation_prompt=False)
            try:
                text = render_turn(state, head)
            except APIError:
                return ""
            if len(encode_turn(state, head, text, salt).ids) > position:
                where = f"message {count - 1} ({messages[count - 1]['role']})"
                return where + (", or the tool list before it" if count == 1 and turn.specs.tools else "")
        return "the generation prompt"

    return describe


def served_model(state, requested: str | None, *, any_name: bool = False) -> str:
    """The model name a reply shows, the one policy of every dialect: a name this server serves (or an
    alias) as asked; none asked (Responses' optional field): the served name; any other name is a 404
    naming the served model, unless ``any_name`` (Messages: Claude Code asks for its own names, claude-sonnet-*
    and a haiku for background work), when the served model answers for it, logged once per name."""
    if requested is None:
        return state.served_name
    if requested in state.model_aliases:
        return requested
    if not any_name:
        raise not_found_model(requested, [state.served_name])
    if requested not in _mapped_models:
        _mapped_models.add(requested)
        log.info("model %r is not served here; %s answers for it", requested, state.served_name)
    return requested


_mapped_models: set[str] = set()  # the names logged as answered by the served model
