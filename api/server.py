"""The HTTP application: OpenAI-style routes plus the llama-server / vLLM utility routes.

Every handler runs on the server's one event loop and talks to the scheduler through the narrow
EngineLoop interface (submit -> async iterator of deltas, abort). Every failure becomes an OpenAI error
object with the right status; the request id travels in the X-Request-Id header of every response.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api import completions, dashboard, messages_api, responses_api, worker_info
from api.chat_protocol import ChatProtocol
from api.config import ServerConfig
from api.errors import APIError, bad_request, internal_error, overloaded, too_large, unauthorized
from api.logging_setup import new_request_id, request_id_var
from api.messages_events import anthropic_error_response
from api.reply_memory import ReplyMemory
from api.sampling_defaults import SamplingDefaults
from api.tenancy import api_keys, is_known_key
from api.schemas import ApplyTemplateRequest, DetokenizeRequest, DevicePoolRequest, TokenizeRequest, parse_body
from engine.loader import LoadedModel, encode_chat_prompt
from engine.units import MIB
from scheduler.engine_loop import EngineLoop
from scheduler.metrics import Metrics

log = logging.getLogger("strata.api")
# answer without the API key: load balancers, scrapers, a router's probes (api/worker_info.py), and the
# dashboard's page, which holds no data: what it shows comes from keyed routes (api/dashboard.py)
_OPEN_PATHS = {"/health", "/metrics", *worker_info.OPEN_PATHS, *dashboard.OPEN_PATHS}
LOADING_RETRY_S = 5  # the Retry-After of a request refused while the model loads


@dataclass
class LoadingState:
    """What the app holds while `strata serve` loads the model and warms its kernels (api/serve.py puts the
    ServerState in its place when both are done): /health answers 503 {"status": "loading"}, every other
    route 503 server_is_overloaded with a Retry-After, as llama-server does while it loads."""

    config: ServerConfig
    is_shutting_down: bool = False


@dataclass
class ServerState:
    """What the handlers share: configuration, the model, the engine loop."""

    config: ServerConfig
    loaded: LoadedModel
    engine: EngineLoop
    metrics: Metrics
    ctx_size: int
    served_name: str
    model_aliases: set[str] = field(default_factory=set)
    is_shutting_down: bool = False
    protocol: ChatProtocol | None = None  # tool-call format, reasoning tags, grammar (api/chat_protocol.py)
    message_start_id: int | None = None  # hybrid models: checkpoint before each message (api/checkpoint_hints.py)
    line_end_ids: frozenset[int] = frozenset()  # hybrid models: tokens that end a line (the same file)
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # what a request that sets none samples with
    replies: ReplyMemory | None = None  # the replies generated, kept as their ids (--keep-reply-tokens on)


def _openai_error(exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def endpoint(handler=None, *, render_error=_openai_error, while_loading: bool = False):
    """Request id, API key, and error objects for a handler(state, http_request, request_id).

    ``render_error(APIError) -> Response`` writes errors in another dialect's shape: ``@endpoint(render_error=
    anthropic_error_response)`` gives the Messages routes Anthropic's error objects. Only a handler marked
    ``while_loading`` runs before the model is ready (it then gets a LoadingState); the others answer 503."""
    if handler is None:
        return functools.partial(endpoint, render_error=render_error, while_loading=while_loading)

    @functools.wraps(handler)
    async def wrapped(http_request: HTTPRequest) -> Response:
        state: ServerState = http_request.app.state.strata
        request_id = new_request_id()
        token = request_id_var.set(request_id)
        try:
            _check_api_key(state, http_request)
            if not (while_loading or isinstance(state, ServerState)):
                raise overloaded(LOADING_RETRY_S, "the model is still loading")
            response = await handler(state, http_request, request_id)
        except APIError as exc:
            response = render_error(exc)
        except Exception:  # a bug: still an error object in the route's shape, and the traceback in the log
            log.exception("unhandled error in %s", http_request.url.path)
            response = render_error(internal_error("internal server error"))
        finally:
            request_id_var.reset(token)
        response.headers["X-Request-Id"] = request_id
        return response

    return wrapped


def _check_api_key(state: ServerState, http_request: HTTPRequest) -> None:
    keys = api_keys(state.config)
    if not keys or http_request.url.path in _OPEN_PATHS:
        return
    given = http_request.headers.get("authorization", "")
    if given.startswith("Bearer ") and is_known_key(given[len("Bearer "):], keys):
        return
    if not is_known_key(http_request.headers.get("x-api-key", ""), keys):  # Anthropic's header (Claude Code)
        raise unauthorized()


async def read_body(state: ServerState, http_request: HTTPRequest) -> bytes:
    """The raw body, refused with 413 as soon as it exceeds --max-body-mib."""
    limit = int(state.config.max_body_mib * MIB)
    declared = http_request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(state.config.max_body_mib)
    body = bytearray()
    async for chunk in http_request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(state.config.max_body_mib)
    return bytes(body)


@endpoint(while_loading=True)
async def health(state: ServerState | LoadingState, http_request, request_id) -> Response:
    if state.is_shutting_down:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if not isinstance(state, ServerState):  # the model and its kernels are still loading
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


@endpoint
async def metrics(state: ServerState, http_request, request_id) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@endpoint
async def slots(state: ServerState, http_request, request_id) -> Response:
    return JSONResponse(state.engine.slots_snapshot())


@endpoint
async def pipeline(state: ServerState, http_request, request_id) -> Response:
    """Per-stage busy time, utilization and queue depth, and each batch group's rows and stage."""
    return JSONResponse(state.engine.pipeline_snapshot())


@endpoint
async def cache(state: ServerState, http_request, request_id) -> Response:
    """The conversation cache per tier: blocks cached / in use / total, parks, restores, drops."""
    snapshot = state.engine.cache_snapshot()
    if state.replies is not None:  # prompts that kept replies as generated (api/prompt_ids.py)
        snapshot["replies"] = state.replies.snapshot()
    return JSONResponse(snapshot)


@endpoint
async def device_pool(state: ServerState, http_request, request_id) -> Response:
    """POST {"max_mib": N} or {"max_blocks": N}: the elastic device pool's ceiling; below its size now, it
    shrinks (moving cached blocks down or parking them, never dropping one) and says where it stopped."""
    body = parse_body(DevicePoolRequest, await read_body(state, http_request))
    blocks = body.max_blocks or max(1, int(body.max_mib * MIB) // state.engine.runner.layout.bytes_per_block)
    try:
        return JSONResponse(await state.engine.resize_device_pool(blocks))
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


@endpoint
async def models(state: ServerState, http_request, request_id) -> Response:
    created = int(state.loaded.info.path.stat().st_mtime)
    card = {"id": state.served_name, "object": "model", "created": created, "owned_by": "strata",
            "max_model_len": state.ctx_size}
    # "models": the same model in Codex's own catalog shape, beside OpenAI's list (api/responses_api.py)
    return JSONResponse({"object": "list", "data": [card], "models": [responses_api.codex_model_info(state)]})


@endpoint
async def tokenize(state: ServerState, http_request, request_id) -> Response:
    body = parse_body(TokenizeRequest, await read_body(state, http_request))
    tokenizer = state.loaded.tokenizer
    if body.kind == "content":  # llama-server: {content, add_special, with_pieces}
        ids = tokenizer.encode(body.content, add_special=bool(body.add_special), parse_special=True)
        if body.with_pieces:
            pieces = [{"id": i, "piece": tokenizer.token_piece(i).decode("utf-8", errors="replace")} for i in ids]
            return JSONResponse({"tokens": pieces})
        return JSONResponse({"tokens": ids})
    if body.kind == "messages":  # vLLM chat form
        prompt = completions.render_chat(state, body.messages, body.tools, body.add_generation_prompt,
                                         body.chat_template_kwargs)
        ids = encode_chat_prompt(tokenizer, prompt)
    else:
        ids = tokenizer.encode(body.prompt, add_special=body.add_special_tokens, parse_special=True)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.ctx_size})


@endpoint
async def detokenize(state: ServerState, http_request, request_id) -> Response:
    body = parse_body(DetokenizeRequest, await read_body(state, http_request))
    vocab = state.loaded.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
    text = state.loaded.tokenizer.decode(body.tokens)
    return JSONResponse({"prompt": text, "content": text})  # vLLM's and llama-server's key


@endpoint
async def apply_template(state: ServerState, http_request, request_id) -> Response:
    body = parse_body(ApplyTemplateRequest, await read_body(state, http_request))
    return JSONResponse({"prompt": completions.render_chat(state, body.messages, body.tools, True,
                                                                     body.chat_template_kwargs)})


@endpoint
async def chat_completions(state: ServerState, http_request, request_id) -> Response:
    return await completions.handle(state, http_request, request_id, "chat", await read_body(state, http_request))


@endpoint(render_error=anthropic_error_response)
async def messages(state: ServerState, http_request, request_id) -> Response:
    """POST /v1/messages (Anthropic's Messages API; ?beta=true and the anthropic-* headers are accepted)."""
    return await messages_api.create_message(state, http_request, request_id, await read_body(state, http_request))


@endpoint(render_error=anthropic_error_response)
async def messages_count_tokens(state: ServerState, http_request, request_id) -> Response:
    return await messages_api.count_tokens(state, http_request, request_id, await read_body(state, http_request))


@endpoint
async def text_completions(state: ServerState, http_request, request_id) -> Response:
    return await completions.handle(state, http_request, request_id, "completion",
                                    await read_body(state, http_request))


@endpoint
async def responses(state: ServerState, http_request, request_id) -> Response:
    return await responses_api.create(state, http_request, request_id, await read_body(state, http_request))


@endpoint
async def response_get(state: ServerState, http_request, request_id) -> Response:
    return await responses_api.retrieve(state, http_request, request_id)


def create_app(state: ServerState | LoadingState, lifespan=None) -> Starlette:
    """The ASGI app; `lifespan` starts and stops the engine loop (see api/serve.py). Given a LoadingState, it
    answers 503 until its owner sets ``app.state.strata`` to the ready ServerState."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", response_get, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/cache", cache, methods=["GET"]),
        Route("/cache/device-pool", device_pool, methods=["POST"]),
        Route("/pipeline", pipeline, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
        *worker_info.create_routes(endpoint),  # what routers probe: /server_info, /model_info, /get_load
        *dashboard.create_routes(endpoint),  # /dashboard and the /requests it reads
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.strata = state
    return app
