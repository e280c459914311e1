"""POST /v1/chat/completions and /v1/completions: validate, render, tokenize, submit, stream or collect.

The reply's events (api/reply_stream.py: one keepalive, abort and disconnect policy for every dialect)
are written as OpenAI's chunks (api/openai_format.py) or collected into the whole response.
"""
from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from api.chat_turn import ChatTurn, build_constraint, render_turn
from api.errors import bad_request
from api.openai_format import ChatStreamEncoder, CompletionStreamEncoder, ResponseBuilder
from api.reply_stream import collect_or_disconnect, reply_events, whole_reply
from api.sampling_defaults import sampling_for
from api.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from api.sse import encode_stream, sse_response
from api.tenancy import cache_salt_for
from api.tool_specs import normalise_tools
from api.turn_runner import fit_max_tokens, served_model, start_chat_turn, submit
from scheduler.request import Request


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


async def handle(state, http_request: HTTPRequest, request_id: str, kind: str, raw: bytes) -> Response:
    """POST /v1/chat/completions (``kind`` "chat") or /v1/completions ("completion")."""
    if kind == "chat":
        return await _handle_chat(state, http_request, request_id, parse_body(ChatCompletionRequest, raw))
    body = parse_body(CompletionRequest, raw)
    served_model(state, body.model)
    prompt_ids = _completion_prompt_ids(state, body)
    if not prompt_ids:
        raise bad_request("the prompt is empty after tokenization", param="prompt")
    constraint = build_constraint(state.protocol, ChatTurn([], normalise_tools(None), body.response_format))
    make_params = sampling_for(body.requested_sampling(), state.sampling_defaults, state.config.seed)
    params = make_params(fit_max_tokens(state, len(prompt_ids), body.requested_max_tokens))
    top_logprobs = body.top_logprobs_count()
    salt = cache_salt_for(state.config, http_request.headers.get("authorization", ""), body.cache_salt)
    request = Request(request_id, prompt_ids, params, top_logprobs=top_logprobs, cache_salt=salt,
                      constraint=constraint)
    events = reply_events(request, submit(state, request))
    builder = ResponseBuilder(kind, request_id, body.model, state.loaded.tokenizer)
    want_logprobs = top_logprobs is not None
    if body.stream:
        encoder = CompletionStreamEncoder(builder, body.include_usage, want_logprobs)
        return sse_response(encode_stream(events, encoder.encode, encoder.on_bug))
    collected = await collect_or_disconnect(http_request, events)
    if collected is None:
        return Response(status_code=499)
    reply = whole_reply(collected)
    echo_text = state.loaded.tokenizer.decode(prompt_ids) if body.echo else ""
    return JSONResponse(builder.whole(echo_text + reply.text, reply.logprobs if want_logprobs else None,
                                      reply.finished.reason, reply.finished.delta.usage))


async def _handle_chat(state, http_request: HTTPRequest, request_id: str, body: ChatCompletionRequest) -> Response:
    served_model(state, body.model)
    top_logprobs = body.top_logprobs_count()
    run = start_chat_turn(state, http_request, request_id, chat_turn_from_body(body),
                          requested_max_tokens=body.requested_max_tokens,
                          make_params=sampling_for(body.requested_sampling(), state.sampling_defaults,
                                                   state.config.seed),
                          client_salt=body.cache_salt, top_logprobs=top_logprobs, num_tools=len(body.tools or []))
    builder = ResponseBuilder("chat", request_id, body.model, state.loaded.tokenizer)
    want_logprobs = top_logprobs is not None
    if body.stream:
        encoder = ChatStreamEncoder(builder, run.assembler, body.include_usage, want_logprobs)
        return sse_response(encode_stream(run.events, encoder.encode, encoder.on_bug, encoder.opening()))
    collected = await collect_or_disconnect(http_request, run.events)
    if collected is None:
        return Response(status_code=499)
    reply = whole_reply(collected)
    assembler = run.assembler
    assembler.feed(reply.text)
    assembler.finish()
    return JSONResponse(builder.chat_whole(assembler.message(), reply.logprobs if want_logprobs else None,
                                           assembler.finish_reason(reply.finished.reason),
                                           reply.finished.delta.usage))
