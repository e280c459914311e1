"""Fuzz the OpenAI routes with schemathesis against OpenAI's own OpenAPI document (a committed subset).

tests/data/openai_openapi_subset.json is written by scripts/trim_openapi.py from openai/openai-openapi (the
upstream commit is in its ``info.x-strata-upstream``). Schemathesis generates bodies from the document, valid
ones and invalid ones, and sends them to a real strata server on SmolLM2; every answer must hold:
- no 5xx, ever;
- every 4xx is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``;
- a streamed 200 carries no error event;
- a 200 to a valid, non-streamed request conforms to the document's response schema
  (``response_schema_conformance``), apart from the omissions listed in ``OMISSIONS``, each with its reason.
The hooks below point every request at the served model and cap its output to a couple of tokens, so the
model never generates for long.

Schemathesis's other built-in checks are not run, each for a reason:
- status_code_conformance: the document lists only 200 and 429 per operation; strata's 400 and 404 are the
  statuses OpenAI itself answers (and the error shape is checked here instead);
- negative_data_rejection: the document requires an Authorization header, which a server without API keys
  does not ask for, and strata ignores unknown fields by design (api/schemas_base.py);
- positive_data_acceptance: strata refuses by name documented fields it cannot honour (n > 1, logit_bias,
  best_of, suffix, a null prompt, ...: api/schemas.py), as the project's standard asks, instead of dropping them.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance

from api.server import ServerState, create_app
from scripts import trim_openapi
from tests.support.server_harness import running_server

SUBSET = Path(__file__).parent / "data" / "openai_openapi_subset.json"
SERVED_NAME = "strata-fuzz"
MAX_OUTPUT_TOKENS = 2  # every generated request's output cap: the fuzz tests the API, not the model
# generated requests per operation, valid and invalid ones together (about a minute for the five operations
# on a busy 2-core machine); raise it locally for a longer hunt
EXAMPLES_PER_OPERATION = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "25"))
OUTPUT_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

schema = schemathesis.openapi.from_path(SUBSET)
schema.config.phases.update(phases=["fuzzing"])
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                max_examples=EXAMPLES_PER_OPERATION, deterministic=True)


@schema.hook
def map_body(context, body: Any) -> Any:
    """The served model's name (most generated names are unknown: a 404 tests nothing past the lookup) and
    at most MAX_OUTPUT_TOKENS of output. An output cap that is not a positive integer is left as generated:
    it is the invalid part of a negative case, and the server must refuse it. (The document's minimum for
    max_output_tokens is 16; strata takes any cap >= 1, and a response's shape does not depend on it.)"""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = SERVED_NAME
    for name in OUTPUT_CAPS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_OUTPUT_TOKENS:
            body[name] = MAX_OUTPUT_TOKENS
    is_responses = context.operation.path == "/responses"
    if not any(name in body for name in OUTPUT_CAPS):
        body["max_output_tokens" if is_responses else "max_tokens"] = MAX_OUTPUT_TOKENS
    if is_responses and "input" not in body:
        # The document makes input optional (a stored prompt or a conversation can stand in); strata has
        # neither, refuses an empty turn by name (tests/test_responses_api.py), and without this hook the
        # generator leaves input out so often that no request would reach the model.
        body["input"] = "Hi"
    return body


@pytest.fixture(scope="module")
def base_url(smollm2):
    # default_max_tokens: a generated request whose cap was null still stops at once
    with running_server(smollm2, ctx_size=512, batch=2, served_model_name=SERVED_NAME,
                        default_max_tokens=MAX_OUTPUT_TOKENS) as (url, _):
        yield url + "/v1"


def test_the_subset_is_the_served_operations_and_self_contained():
    document = orjson.loads(SUBSET.read_bytes())
    app = create_app(ServerState(*[None] * 7))  # the routes only: no model, no engine
    served = {(route.path, method.lower()) for route in app.routes for method in getattr(route, "methods", ())}
    operations = {(path, method) for path, methods in document["paths"].items() for method in methods}
    assert operations == set(trim_openapi.SERVED_OPERATIONS)
    assert {("/v1" + path, method) for path, method in operations} <= served
    components = {kind: entries for kind, entries in document["components"].items() if kind != "securitySchemes"}
    assert trim_openapi.referenced_components(document, list(document["paths"].values())) == components
    assert re.fullmatch(r"[0-9a-f]{40}", document["info"]["x-strata-upstream"]["commit"])


def _assert_openai_error(response) -> None:
    assert _content_type(response).startswith("application/json"), response.text
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


@pytest.mark.slow
@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_openai_routes_answer_every_generated_request(case, base_url):
    response = case.call(base_url=base_url, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text}"
    if response.status_code >= 400:
        _assert_openai_error(response)
        return
    if _content_type(response).startswith("text/event-stream"):
        _assert_stream_has_no_error(response)  # the document types one event, not the stream: not validated
        return
    if case.meta.generation.mode == GenerationMode.POSITIVE:
        # Only a valid request's answer is held to the document: strata accepts some invalid ones (unknown
        # tool objects are skipped and logged, api/tool_specs.py) and echoes them back in the response.
        _strata_conformant(case, response)


def _assert_stream_has_no_error(response) -> None:
    """A stream that started must not fail later: no OpenAI error object and no Responses error event."""
    for line in response.content.decode("utf-8").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = orjson.loads(line.removeprefix("data: "))
        assert "error" not in event or event.get("type", "").startswith("response."), line
        assert event.get("type") not in ("error", "response.failed"), line


def _strata_conformant(case, response) -> None:
    """``response_schema_conformance`` on a copy of the body with strata's known, deliberate omissions
    filled in (OMISSIONS), so any other departure from the document still fails."""
    body = orjson.loads(response.content)
    for fill in OMISSIONS.get(case.path, ()):
        fill(body)
    filled = schemathesis.Response(status_code=response.status_code, headers=response.headers,
                                   content=orjson.dumps(body), request=response.request,
                                   elapsed=response.elapsed, verify=response.verify)
    case.validate_response(filled, checks=[response_schema_conformance])


def _content_type(response) -> str:
    return ",".join(response.headers.get("content-type", []))


def _fill_cache_write_tokens(body: dict) -> None:
    details = (body.get("usage") or {}).get("input_tokens_details")
    if isinstance(details, dict):
        details.setdefault("cache_write_tokens", 0)


# Fields the document marks required that strata leaves out, each with why; a fill sets a placeholder on
# the copy that is validated, so the rest of the object is still checked.
OMISSIONS = {
    # ResponseUsage.input_tokens_details.cache_write_tokens: strata does not know, when it answers, which
    # prompt tokens its conversation cache will keep (only whole blocks are cached, and parking or dropping
    # them is decided later), so it reports cached_tokens (what was reused) and no guess at writes.
    "/responses": (_fill_cache_write_tokens,),
}
