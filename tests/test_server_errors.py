"""Bad input over HTTP: an OpenAI error object with the right status, never a 500, and the server goes on."""
import httpx
import openai
import pytest

from api.tenancy import is_known_key
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
GOOD = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def url(smollm2):
    with running_server(smollm2, ctx_size=512, batch=2, max_body_mib=0.01) as (base, _):
        yield base


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert response.headers["x-request-id"].startswith("req-")
    return error


def test_invalid_json_is_400(url):
    assert "invalid JSON" in _error(httpx.post(url + CHAT, content=b'{"model": '), 400)["message"]


def test_malformed_utf8_is_400(url):
    raw = b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    assert "UTF-8" in _error(httpx.post(url + CHAT, content=raw), 400)["message"]


def test_empty_messages_is_400(url):
    error = _error(httpx.post(url + CHAT, json={**GOOD, "messages": []}), 400)
    assert error["param"] == "messages"


def test_a_subnormal_temperature_samples_greedily_instead_of_failing_the_step(url):
    # found by tests/test_openapi_fuzz.py: temperature 5e-324 was a 500 ("Probabilities contain NaN")
    body = {**GOOD, "temperature": 5e-324, "presence_penalty": -0.1}
    first, second = (httpx.post(url + CHAT, json=body, timeout=60) for _ in range(2))
    assert first.status_code == 200, first.text
    greedy = httpx.post(url + CHAT, json=GOOD, timeout=60).json()["choices"][0]["message"]["content"]
    assert first.json()["choices"][0]["message"]["content"] == greedy
    assert second.json()["choices"][0]["message"]["content"] == greedy


def test_absurd_max_tokens_is_clamped_to_the_room_the_context_leaves(url):
    response = httpx.post(url + CHAT, json={**GOOD, "max_tokens": 10**9, "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 512


def test_a_request_without_max_tokens_gets_the_operators_default(smollm2):
    body = {k: v for k, v in GOOD.items() if k != "max_tokens"}
    with running_server(smollm2, ctx_size=512, batch=1, default_max_tokens=3) as (base, _):
        choice = httpx.post(base + CHAT, json={**body, "stop": None}, timeout=60).json()
        longer = httpx.post(base + CHAT, json={**body, "max_tokens": 6}, timeout=60).json()
    assert choice["usage"]["completion_tokens"] == 3 and choice["choices"][0]["finish_reason"] == "length"
    assert longer["usage"]["completion_tokens"] > 3  # an explicit max_tokens is the client's own


def test_a_prompt_longer_than_the_context_is_400_naming_the_numbers_and_the_flag(url):
    long_prompt = {**GOOD, "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 7}
    error = _error(httpx.post(url + CHAT, json=long_prompt), 400)
    assert "512" in error["message"] and "7 for max_tokens" in error["message"] and "--ctx-size" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_negative_temperature_is_400(url):
    assert _error(httpx.post(url + CHAT, json={**GOOD, "temperature": -1}), 400)["param"] == "temperature"


def test_negative_max_tokens_is_400(url):
    assert _error(httpx.post(url + CHAT, json={**GOOD, "max_tokens": -5}), 400)["param"] == "max_tokens"


def test_unknown_model_is_404(url):
    error = _error(httpx.post(url + CHAT, json={**GOOD, "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


def test_body_over_the_limit_is_413(url):
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 20_000}]}
    assert _error(httpx.post(url + CHAT, json=big), 413)["code"] == "request_too_large"


def test_out_of_range_prompt_token_ids_are_400(url):
    body = {"model": "smollm2", "prompt": [1, 2, 10**7], "max_tokens": 1}
    assert _error(httpx.post(url + "/v1/completions", json=body), 400)["param"] == "prompt"


def test_server_still_answers_after_bad_requests(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(**GOOD)
    assert reply.usage.completion_tokens == 2


def test_an_api_key_matches_only_whole_and_any_header_text_is_compared():
    keys = ["sekrit", "other"]
    assert is_known_key("other", keys) and is_known_key("sekrit", keys)
    assert not any(is_known_key(given, keys) for given in ("sekri", "sekrit ", "", "sekritother"))
    assert not is_known_key("s\u00e9krit", keys)  # non-ASCII header text (latin-1): compared, not a TypeError


def test_api_key_is_required_when_configured(smollm2):
    with running_server(smollm2, ctx_size=256, batch=1, api_key="sekrit") as (base, _):
        assert _error(httpx.post(base + CHAT, json=GOOD), 401)["type"] == "authentication_error"
        wrong = httpx.post(base + CHAT, json=GOOD, headers={"Authorization": "Bearer nope"})
        assert _error(wrong, 401)["code"] == "invalid_api_key"
        assert httpx.get(base + "/health").status_code == 200  # probes need no key
        client = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        assert client.chat.completions.create(**GOOD).usage.completion_tokens == 2
