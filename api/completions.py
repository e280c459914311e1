"""POST /v1/chat/completions and /v1/completions: validate, render, tokenize, submit, stream or collect.

A client that disconnects aborts its request (streaming: the response generator is closed; whole
responses: a watcher on the ASGI receive channel), which frees its slot before the next engine step.
"""
from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from api.chat_output import ReplyAssembler
from api.chat_turn import ChatTurn, build_constraint, render_turn
from api.errors import bad_request, internal_error, not_found_model
from api.openai_format import ResponseBuilder, sse
from api.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from api.tenancy import cache_salt_for
from api.tool_specs import normalise_tools
from api.turn_runner import collect_or_disconnect, fit_max_tokens, start_chat_turn, submit
from scheduler.request import Delta, Request



def render_chat(state, messages, tools, add_generation_prompt: bool, template_kwargs: dict | None = None) -> str:
    """Messages (schema objects) through the model's chat template, as a chat completion renders them
    (tools normalised, the generic format's system prompt); template errors become 400s."""
    turn = ChatTurn([m.as_template_dict() for m in messages], normalise_tools(tools),
                    template_kwargs=dict(template_kwargs or {}), add_generation_prompt=add_generation_prompt)
    return render_turn(state, turn)


def chat_turn_from_body(body: ChatCompletionRequest) -> ChatTurn:
    """The dialect-free turn of a chat-completions body."""
    specs = normalise_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return ChatTurn(body.template_messages(), specs, body.response_format, kwargs, body.add_generation_prompt,
                    conversation_key=body.prompt_cache_key)


def _completion_prompt_ids(state, body) -> list[int]:
    tokenizer = state.loaded.tokenizer
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
    if kind == "chat":
        return await _handle_chat(state, http_request, request_id, parse_body(ChatCompletionRequest, raw))
    body = parse_body(CompletionRequest, raw)
    _check_model(state, body.model)
    prompt_ids = _completion_prompt_ids(state, body)
    if not prompt_ids:
        raise bad_request("the prompt is empty after tokenization", param="prompt")
    constraint = build_constraint(state.protocol, ChatTurn([], normalise_tools(None), body.response_format))
    params = body.sampling_params_for(fit_max_tokens(state, len(prompt_ids), body.requested_max_tokens),
                                      state.sampling_defaults, default_seed=state.config.seed)
    top_logprobs = body.top_logprobs_count()
    salt = cache_salt_for(state.config, http_request.headers.get("authorization", ""), body.cache_salt)
    stream = submit(state, Request(request_id, prompt_ids, params, top_logprobs=top_logprobs, cache_salt=salt,
                                   constraint=constraint))
    builder = ResponseBuilder(kind, request_id, body.model, state.loaded.tokenizer)
    if body.stream:
        return StreamingResponse(_sse_events(stream, builder, body.include_usage, top_logprobs is not None),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    echo_text = state.loaded.tokenizer.decode(prompt_ids) if body.echo else ""
    return await _whole_response(http_request, stream, builder, top_logprobs is not None, echo_text)


async def _handle_chat(state, http_request: HTTPRequest, request_id: str, body: ChatCompletionRequest) -> Response:
    _check_model(state, body.model)
    top_logprobs = body.top_logprobs_count()
    run = start_chat_turn(state, http_request, request_id, chat_turn_from_body(body),
                          requested_max_tokens=body.requested_max_tokens,
                          make_params=lambda n: body.sampling_params_for(n, state.sampling_defaults,
                                                                         default_seed=state.config.seed),
                          client_salt=body.cache_salt, top_logprobs=top_logprobs, num_tools=len(body.tools or []))
    builder = ResponseBuilder("chat", request_id, body.model, state.loaded.tokenizer)
    want_logprobs = top_logprobs is not None
    if body.stream:
        events = _chat_sse_events(run.stream, builder, run.assembler, body.include_usage, want_logprobs)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole_chat(http_request, run.stream, builder, run.assembler, want_logprobs)


async def _chat_sse_events(stream: AsyncIterator[Delta], builder: ResponseBuilder, assembler: ReplyAssembler,
                           include_usage: bool, want_logprobs: bool) -> AsyncIterator[bytes]:
    """Chat chunks: the role first, then parsed deltas (markup held back by the parser), a last chunk with the
    finish reason (always, even after an error), the usage chunk when asked, [DONE]."""
    try:
        yield sse(builder.chat_chunk({"role": "assistant", "content": ""}))
        async for delta in stream:
            if delta.error:
                yield sse({"error": {"message": delta.error, "type": "server_error", "param": None, "code": None}})
            parsed = assembler.feed(delta.text)
            logprobs = delta.logprobs if want_logprobs else None
            body = assembler.delta(parsed)
            if body or logprobs:
                yield sse(builder.chat_chunk(body, logprobs=logprobs))
            if delta.finish_reason is not None:
                tail = assembler.delta(assembler.finish())
                if tail:
                    yield sse(builder.chat_chunk(tail))
                yield sse(builder.chat_chunk({}, assembler.finish_reason(delta.finish_reason)))
                if include_usage:
                    yield sse(builder.usage_chunk(delta.usage))
                break
        yield sse("[DONE]")
    finally:
        await stream.aclose()  # a disconnect lands here: closing the stream aborts the request


async def _whole_chat(http_request, stream, builder: ResponseBuilder, assembler: ReplyAssembler,
                      want_logprobs: bool) -> Response:
    outcome = await collect_or_disconnect(http_request, stream)
    if outcome is None:
        return Response(status_code=499)
    text, logprobs, last = outcome
    if last.finish_reason == "error":
        raise internal_error(last.error or "generation failed")
    assembler.feed(text)
    assembler.finish()
    return JSONResponse(builder.chat_whole(assembler.message(), logprobs if want_logprobs else None,
                                           assembler.finish_reason(last.finish_reason), last.usage))


async def _sse_events(stream: AsyncIterator[Delta], builder: ResponseBuilder, include_usage: bool,
                      want_logprobs: bool) -> AsyncIterator[bytes]:
    try:
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
    outcome = await collect_or_disconnect(http_request, stream)
    if outcome is None:
        return Response(status_code=499)
    text, logprobs, last = outcome
    if last.finish_reason == "error":
        raise internal_error(last.error or "generation failed")
    finish = "stop" if last.finish_reason == "abort" else last.finish_reason
    return JSONResponse(builder.whole(echo_text + text, logprobs if want_logprobs else None, finish, last.usage))
