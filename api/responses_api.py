"""POST /v1/responses (the OpenAI Responses API, all Codex CLI speaks) and GET /v1/responses/{id}.

One request is one chat turn: the body becomes a ``ChatTurn`` (api/responses_schema.py) and runs through
``start_chat_turn`` exactly as a chat completion does, so tools, grammars, reasoning and the conversation
cache behave the same; only the output differs (api/responses_events.py).

How a response ends, streamed or whole:
- the reply finished: ``response.completed``;
- it hit max_output_tokens (or the context's room): ``response.incomplete``, reason "max_output_tokens";
- the prompt does not fit the context: streamed, ``response.failed`` with error.code
  "context_length_exceeded" (Codex reads that code there and compacts its history; as a 400 it would only
  show an error); whole, the 400 chat completions gives;
- the engine failed or the server is stopping: ``response.failed`` (code "server_error"; Codex retries).
A stream always ends with one of those events, never by just closing.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from api.errors import APIError
from api.reply_stream import Failed, Finished, Keepalive, Piece, ReplyEvent, Started, collect_or_disconnect
from api.response_store import ResponseStore
from api.responses_events import ResponseWriter
from api.responses_schema import ResponsesRequest, turn_from_request
from api.sampling_defaults import sampling_for
from api.schemas import parse_body
from api.sse import encode_stream, sse_frame, sse_response
from api.turn_runner import TurnRun, served_model, start_chat_turn
from engine.sampling import SamplingParams

log = logging.getLogger("strata.api")


def response_store(state) -> ResponseStore:
    """The server's store (created on first use, so ServerState needs no knowledge of it)."""
    store = getattr(state, "response_store", None)
    if store is None:
        store = state.response_store = ResponseStore()
    return store


# Codex replaces its own long system prompt with a catalog entry's base_instructions (it refuses an entry
# without them), so a client configured to read this catalog gets this short one, sized for small local models.
CODEX_BASE_INSTRUCTIONS = (
    "You are a coding agent running in the user's terminal, in their workspace. Use the tools to read files, "
    "run commands and make changes; keep going until the task is done, then reply briefly with what you did.")


def codex_model_info(state) -> dict[str, Any]:
    """The served model in Codex's model-catalog shape (codex-rs ``ModelInfo``), for ``GET /v1/models``'s
    "models" key: a client that reads it (Codex's ``model_catalog_json``) learns the context window, so its
    auto-compaction starts in time, and that calls come one at a time."""
    return {"slug": state.served_name, "display_name": state.served_name, "description": "served by strata",
            "default_reasoning_level": None, "supported_reasoning_levels": [], "shell_type": "shell_command",
            "visibility": "list", "supported_in_api": True, "priority": 0, "upgrade": None,
            "base_instructions": CODEX_BASE_INSTRUCTIONS, "supports_reasoning_summaries": False,
            "support_verbosity": False, "default_verbosity": None, "apply_patch_tool_type": None,
            "truncation_policy": {"mode": "tokens", "limit": max(256, state.ctx_size // 8)},
            "supports_parallel_tool_calls": False, "context_window": state.ctx_size,
            "experimental_supported_tools": [], "input_modalities": ["text"]}


def _echo(body: ResponsesRequest, parallel_by_default: bool, params: SamplingParams) -> dict[str, Any]:
    """The request fields a Response object repeats (parallel_tool_calls, temperature and top_p as they
    applied: ``params`` is what the request samples with)."""
    parallel = parallel_by_default if body.parallel_tool_calls is None else body.parallel_tool_calls
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": parallel, "previous_response_id": body.previous_response_id,
            "reasoning": {key: (body.reasoning or {}).get(key) for key in ("effort", "summary")},
            "store": body.store, "temperature": params.temperature,
            "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": params.top_p, "truncation": "disabled",
            "metadata": body.metadata or {}, "prompt_cache_key": body.prompt_cache_key, "background": False}


async def create(state, http_request: HTTPRequest, request_id: str, raw: bytes) -> Response:
    body = parse_body(ResponsesRequest, raw)
    model = served_model(state, body.model)
    store = response_store(state)
    history = store.get(body.previous_response_id, "previous_response_id").conversation \
        if body.previous_response_id else []
    turn = turn_from_request(body, history)

    make_params = sampling_for(body.requested_sampling(), state.sampling_defaults, state.config.seed)

    def writer_for(custom_tool_names: frozenset[str], params: SamplingParams) -> ResponseWriter:
        return ResponseWriter("resp_" + request_id.removeprefix("req-"), model,
                              _echo(body, state.protocol.tool_format.parallel_by_default, params), custom_tool_names)

    try:
        run = start_chat_turn(state, http_request, request_id, turn, requested_max_tokens=body.max_output_tokens,
                              make_params=make_params, num_tools=len(body.tools or []))
    except APIError as exc:
        if not body.stream or exc.code != "context_length_exceeded":
            raise
        writer = writer_for(frozenset(), make_params(1))  # no reply: the echo reads only temperature and top_p
        events = writer.start() + writer.finish("failed", error={"code": exc.code, "message": exc.message})
        return sse_response([sse_frame(e, e["type"]) for e in events])
    writer = writer_for(run.prepared.custom_tool_names, run.request.params)
    conversation = history + body.input_items()

    def keep() -> None:  # once the response has ended (not when the client went away first)
        if body.store:
            store.put(writer.response, conversation + writer.response["output"])

    encoder = ResponsesEncoder(writer, run, keep)
    opening = [sse_frame(e, e["type"]) for e in writer.start()]
    if body.stream:
        return sse_response(encode_stream(run.events, encoder.frames, encoder.on_bug, opening))
    collected = await collect_or_disconnect(http_request, run.events)
    if collected is None:  # the client went away first (the request is then aborted)
        return Response(status_code=499)
    for event in collected:
        encoder.encode(event)
    return JSONResponse(writer.response)


class ResponsesEncoder:
    """The Responses API events (dicts) of a reply's events: a keepalive event for each keepalive; a finish
    as ``response.completed`` (``response.incomplete`` at the token budget); a failure, or a reply the server
    stopped (shutdown: Codex retries a failed response), as ``response.failed``. ``on_end`` runs once the
    response has ended (not when the client went away first)."""

    def __init__(self, writer: ResponseWriter, run: TurnRun, on_end: Callable[[], None]):
        self.writer, self.assembler, self.on_end = writer, run.assembler, on_end

    def encode(self, event: ReplyEvent) -> list[dict]:
        """The events of one reply event (mutates the writer and the assembler)."""
        writer, assembler = self.writer, self.assembler
        if isinstance(event, Started):
            return []
        if isinstance(event, Keepalive):
            return [writer.keepalive()]
        if isinstance(event, Piece):
            return writer.feed(assembler.feed(event.delta.text, len(event.delta.token_ids)))
        delta = event.delta
        if isinstance(event, Failed) or event.interrupted:
            why = "generation stopped: the server is shutting down" if isinstance(event, Finished) else event.message
            events = writer.feed(assembler.finish()) + writer.finish(
                "failed", delta.usage, assembler.reasoning_tokens, error={"code": "server_error", "message": why})
        else:
            events = writer.feed(assembler.feed(delta.text, len(delta.token_ids))) + writer.feed(assembler.finish())
            status = "incomplete" if event.reason == "length" else "completed"
            events += writer.finish(status, delta.usage, assembler.reasoning_tokens)
        self.on_end()
        return events

    def frames(self, event: ReplyEvent) -> list[bytes]:
        return [sse_frame(e, e["type"]) for e in self.encode(event)]

    def on_bug(self) -> list[bytes]:
        """A bug: the stream still ends the way clients expect."""
        if self.writer.response["status"] != "in_progress":
            return []
        failed = self.writer.finish("failed", error={"code": "server_error", "message": "internal error"})[-1]
        return [sse_frame(failed, failed["type"])]


async def retrieve(state, http_request: HTTPRequest, request_id: str) -> Response:
    """GET /v1/responses/{id}: a response stored with store=true."""
    return JSONResponse(response_store(state).get(http_request.path_params["response_id"]).response)
