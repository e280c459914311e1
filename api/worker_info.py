"""What a cache-aware router asks a worker, in the shapes SGLang's router (PyPI `sglang-router`) reads.

The router (0.3.x, Rust) registers a worker by GET /health, then GET /server_info and GET /model_info: the
worker's model id is `served_model_name` (else `model_path`); the rest are labels on its model card. With
`--policy power_of_two` it polls GET /get_load every 30 s and balances on the sum of `num_tokens` over the
array it returns (one entry per data-parallel rank; strata is one rank). The `/get_*` spellings are the
older names of the same routes (sglang's own server answers both). docs/DEPLOY.md says which router
settings go with these; tests/test_router_worker.py runs the real router against two servers.
"""
from __future__ import annotations

from importlib import metadata

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

# Open like /health (no API key): a router probes with no key unless told one per worker, and would
# register a keyed replica under the model id "unknown". They tell what is served, not what was asked.
OPEN_PATHS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load")
# GGUF `general.architecture` -> the Hugging Face class name sglang reports in `architectures`
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM"}


def _version() -> str:
    try:
        return metadata.version("strata")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "0+unknown"


def server_info(state) -> dict:
    """GET /server_info: the serving configuration (sglang's key names where one exists)."""
    engine = state.engine
    return {
        "served_model_name": state.served_name,
        "model_path": str(state.loaded.path),
        "tokenizer_path": None,  # the tokenizer is inside the GGUF; routers must not try to load one
        "dp_size": 1,
        "tp_size": 1,
        "context_length": state.ctx_size,
        "max_running_requests": engine.num_slots,
        "max_total_tokens": engine.device_pool_tokens,
        "max_prefill_tokens": engine.prefill_step_tokens,
        "version": _version(),
        "engine": "strata",
        "backend": state.loaded.model.backend.name,
    }


def model_info(state) -> dict:
    """GET /model_info: what the model is (a generative chat model; its architecture)."""
    arch = state.loaded.model.config.arch
    info = {"model_path": str(state.loaded.path), "tokenizer_path": None, "is_generation": True,
            "model_type": arch, "served_model_name": state.served_name}
    if arch in _HF_ARCHITECTURES:
        info["architectures"] = [_HF_ARCHITECTURES[arch]]
    return info


def load(state) -> list[dict]:
    """GET /get_load: one entry per data-parallel rank, as sglang answers it."""
    now = state.engine.load_snapshot()
    return [{"dp_rank": 0, "num_reqs": now["running"], "num_waiting_reqs": now["waiting"],
             "num_tokens": now["tokens"]}]


def create_routes(endpoint) -> list[Route]:
    """The routes, each wrapped by the server's `endpoint` decorator (request id, API key, error objects)."""
    def route(path: str, build) -> Route:
        async def handler(state, http_request, request_id) -> Response:
            return JSONResponse(build(state))
        handler.__name__ = build.__name__
        return Route(path, endpoint(handler), methods=["GET"])

    return [route("/server_info", server_info), route("/get_server_info", server_info),
            route("/model_info", model_info), route("/get_model_info", model_info), route("/get_load", load)]
