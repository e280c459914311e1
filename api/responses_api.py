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

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from api.errors import APIError, not_found_model
from api.response_store import ResponseStore
from api.responses_events import ResponseWriter, sse_event
from api.responses_schema import ResponsesRequest, turn_from_request
from api.sampling_defaults import SamplingDefaults
from api.schemas import parse_body
from api.turn_runner import TurnRun, start_chat_turn, wait_for_disconnect
from engine.sampling import SamplingParams

log = logging.getLogger("strata.api")
KEEPALIVE_S = 15.0  # a keepalive event after this long without one (prefill of a long prompt on a CPU)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


def sampling_for(body: ResponsesRequest, defaults: SamplingDefaults,
                 default_seed: int | None) -> Callable[[int], SamplingParams]:
    """max_tokens -> the request's sampling; what the body leaves out takes the model's ``defaults``."""
    def make(max_tokens: int) -> SamplingParams:
        seed = default_seed if body.seed is None else body.seed
        return defaults.params(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=seed)
    return make


async def create(state, http_request: HTTPRequest, request_id: str, raw: bytes) -> Response:
    body = parse_body(ResponsesRequest, raw)
    model = state.served_name if body.model is None else body.model
    if model not in state.model_aliases:
        raise not_found_model(model, [state.served_name])
    store = response_store(state)
    history = store.get(body.previous_response_id, "previous_response_id").conversation \
        if body.previous_response_id else []
    turn = turn_from_request(body, history)

    make_params = sampling_for(body, state.sampling_defaults, state.config.seed)

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
        return StreamingResponse(iter([sse_event(e) for e in events]), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)
    writer = writer_for(run.prepared.custom_tool_names, run.request.params)
    conversation = history + body.input_items()

    def keep() -> None:  # once the response has ended (not when the client went away first)
        if body.store:
            store.put(writer.response, conversation + writer.response["output"])

    events = _events(run, writer, keep)
    if body.stream:
        return StreamingResponse(_sse(events, writer), media_type="text/event-stream", headers=_SSE_HEADERS)
    return await _whole(http_request, events, writer)


async def _events(run: TurnRun, writer: ResponseWriter, on_end: Callable[[], None]) -> AsyncIterator[dict]:
    """Every event of the response, keepalives included; ends with a terminal event, and closing it early
    (a client that went away) aborts the engine request."""
    assembler, stream = run.assembler, run.stream
    pending: asyncio.Future | None = None
    try:
        for event in writer.start():
            yield event
        while True:
            pending = asyncio.ensure_future(stream.__anext__())
            while not (await asyncio.wait({pending}, timeout=KEEPALIVE_S))[0]:
                yield writer.keepalive()
            try:
                delta = pending.result()
            except StopAsyncIteration:  # the engine never ends a stream without a finish reason; be safe anyway
                delta = None
            pending = None
            if delta is None or delta.finish_reason in ("error", "abort"):
                why = (delta.error if delta is not None else None) or "generation stopped: the server is shutting down"
                for event in writer.feed(assembler.finish()):
                    yield event
                for event in writer.finish("failed", delta.usage if delta else None, assembler.reasoning_tokens,
                                           error={"code": "server_error", "message": why}):
                    yield event
                break
            for event in writer.feed(assembler.feed(delta.text, len(delta.token_ids))):
                yield event
            if delta.finish_reason is not None:
                for event in writer.feed(assembler.finish()):
                    yield event
                status = "incomplete" if delta.finish_reason == "length" else "completed"
                for event in writer.finish(status, delta.usage, assembler.reasoning_tokens):
                    yield event
                break
        on_end()
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()  # aborts the request when the reply is not complete


async def _sse(events: AsyncIterator[dict], writer: ResponseWriter) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield sse_event(event)
    except Exception:  # a bug: logged, and the stream still ends the way clients expect
        log.exception("the response stream failed")
        if writer.response["status"] == "in_progress":
            yield sse_event(writer.finish("failed", error={"code": "server_error", "message": "internal error"})[-1])
    finally:
        await events.aclose()


async def _whole(http_request: HTTPRequest, events: AsyncIterator[dict], writer: ResponseWriter) -> Response:
    """The whole Response object, or 499 when the client went away first (the request is then aborted)."""
    async def drain() -> None:
        async for _ in events:
            pass

    drainer = asyncio.ensure_future(drain())
    watcher = asyncio.ensure_future(wait_for_disconnect(http_request))
    done, _ = await asyncio.wait({drainer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if drainer not in done:
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
        await events.aclose()
        return Response(status_code=499)
    watcher.cancel()
    drainer.result()
    return JSONResponse(writer.response)


async def retrieve(state, http_request: HTTPRequest, request_id: str) -> Response:
    """GET /v1/responses/{id}: a response stored with store=true."""
    return JSONResponse(response_store(state).get(http_request.path_params["response_id"]).response)
