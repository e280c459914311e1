"""POST /v1/chat/completions and /v1/completions: validate, render, tokenize, submit, stream or collect.

A client that disconnects aborts its request (streaming: the response generator is closed; whole
responses: a watcher on the ASGI receive channel), which frees its slot before the next engine step.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from api.errors import APIError, bad_request, context_overflow, internal_error, not_found_model, overloaded
from api.openai_format import ResponseBuilder, sse
from api.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from api.tenancy import cache_salt_for
from engine.loader import encode_chat_prompt
from scheduler.engine_loop import QueueFullError, ShuttingDownError
from scheduler.request import Delta, Request

_RETRY_AFTER_S = 2


def render_chat(state, messages, tools, add_generation_prompt: bool) -> str:
    """Messages (schema objects) through the model's chat template; template errors become 400s."""
    dicts = [m.as_template_dict() for m in messages]
    try:
        return state.loaded.chat_template.render(dicts, tools=tools, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from exc


def _prompt_ids(state, body, kind: str) -> list[int]:
    tokenizer = state.loaded.tokenizer
    if kind == "chat":
        return encode_chat_prompt(tokenizer, render_chat(state, body.messages, body.tools, body.add_generation_prompt))
    prompt = body.prompt_ids_or_text()
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special=True, parse_special=True)
    bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_request(f"token ids out of range [0, {tokenizer.vocab_size}): {bad[:5]}", param="prompt")
    return list(prompt)


def _check_model(state, name: str) -> None:
    if name not in state.model_aliases:
        raise not_found_model(name, [state.served_name])


async def handle(state, http_request: HTTPRequest, request_id: str, kind: str, raw: bytes) -> Response:
    body = parse_body(ChatCompletionRequest if kind == "chat" else CompletionRequest, raw)
    _check_model(state, body.model)
    prompt_ids = _prompt_ids(state, body, kind)
    if not prompt_ids:
        raise bad_request("the prompt is empty after tokenization", param="prompt" if kind != "chat" else "messages")
    room = state.ctx_size - len(prompt_ids)
    params = body.sampling_params(default_max_tokens=max(room, 1), default_seed=state.config.seed)
    if len(prompt_ids) + params.max_tokens > state.ctx_size:
        raise context_overflow(len(prompt_ids), params.max_tokens, state.ctx_size)
    top_logprobs = body.top_logprobs_count()
    salt = cache_salt_for(state.config, http_request.headers.get("authorization", ""), body.cache_salt)
    request = Request(request_id, prompt_ids, params, top_logprobs=top_logprobs, cache_salt=salt,
                      describe_position=_position_describer(state, body) if kind == "chat" else None)
    try:
        stream = state.engine.submit(request)
    except QueueFullError as exc:
        raise overloaded(_RETRY_AFTER_S, str(exc)) from exc
    except ShuttingDownError as exc:
        raise overloaded(_RETRY_AFTER_S, str(exc)) from exc
    builder = ResponseBuilder(kind, request_id, body.model, state.loaded.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse_events(stream, builder, include_usage, top_logprobs is not None),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    echo_text = state.loaded.tokenizer.decode(prompt_ids) if kind == "completion" and body.echo else ""
    return await _whole_response(http_request, stream, builder, top_logprobs is not None, echo_text)


def _position_describer(state, body):
    """token position -> which chat message it falls in, for the log line that explains a cache miss.

    Renders growing prefixes of the conversation only when asked (a miss), never on the hot path."""
    def describe(position: int) -> str:
        tokenizer, messages = state.loaded.tokenizer, body.messages
        for count in range(1, len(messages) + 1):
            try:
                text = render_chat(state, messages[:count], body.tools, add_generation_prompt=False)
            except APIError:
                return ""
            if len(encode_chat_prompt(tokenizer, text)) > position:
                where = f"message {count - 1} ({messages[count - 1].role})"
                return where + (", or the tool list before it" if count == 1 and body.tools else "")
        return "the generation prompt"

    return describe


async def _sse_events(stream: AsyncIterator[Delta], builder: ResponseBuilder, include_usage: bool,
                      want_logprobs: bool) -> AsyncIterator[bytes]:
    try:
        if builder.kind == "chat":
            yield sse(builder.chunk(None, first=True))
        async for delta in stream:
            if delta.error:
                yield sse({"error": {"message": delta.error, "type": "server_error", "param": None, "code": None}})
            if delta.finish_reason == "abort":  # server shutdown: end the stream the way clients expect
                delta.finish_reason = "stop"
            if delta.text or delta.finish_reason or (want_logprobs and delta.logprobs):
                yield sse(builder.chunk(delta, want_logprobs=want_logprobs))
            if delta.finish_reason is not None:
                if include_usage:
                    yield sse(builder.usage_chunk(delta.usage))
                break
        yield sse("[DONE]")
    finally:
        await stream.aclose()  # a disconnect lands here: closing the stream aborts the request


async def _whole_response(http_request, stream, builder, want_logprobs: bool, echo_text: str) -> Response:
    async def collect():
        text, logprobs, last = [], [], None
        async for delta in stream:
            text.append(delta.text)
            logprobs += delta.logprobs
            last = delta
        return "".join(text), logprobs, last

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
    done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if collector not in done:  # the client went away: stop computing for it
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        await stream.aclose()
        return Response(status_code=499)
    watcher.cancel()
    text, logprobs, last = collector.result()
    if last.finish_reason == "error":
        raise internal_error(last.error or "generation failed")
    finish = "stop" if last.finish_reason == "abort" else last.finish_reason
    return JSONResponse(builder.whole(echo_text + text, logprobs if want_logprobs else None, finish, last.usage))


async def _wait_for_disconnect(http_request: HTTPRequest) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return
