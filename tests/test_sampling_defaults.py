"""Sampling defaults for requests that set none (api/sampling_defaults.py): the order of precedence, field by
field (request > --default-temperature > GGUF general.sampling.* > model store entry > llama-server's), what each
dialect builds from a body without sampling fields, the start-up line, and the reply budget without max_tokens."""
import logging
from types import SimpleNamespace

import gguf
import httpx
import orjson
import pytest

from api.config import ServerConfig
from api.errors import APIError
from api.messages_schema import MessagesRequest
from api.responses_schema import ResponsesRequest
from api.sampling_defaults import SamplingDefaults, load_sampling_defaults, resolve_sampling_defaults, sampling_for
from api.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from api.turn_runner import fit_max_tokens
from engine.loader import open_model
from engine.model_store import KNOWN_MODELS
from tests.support.server_harness import running_server
from tests.support.tiny_gguf import write_tiny_gguf

QWEN_FILE = KNOWN_MODELS["qwen2.5-coder-0.5b"].file_name
LLAMA_SERVER = (0.8, 40, 0.95, 0.05, 1.0, 64)


def values(d: SamplingDefaults) -> tuple:
    return d.temperature, d.top_k, d.top_p, d.min_p, d.repetition_penalty, d.repetition_last_n


def write_header(path, **sampling) -> str:
    """A GGUF of metadata only, its general.sampling.* keys written by the gguf package's own writer."""
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    for name, value in sampling.items():
        getattr(writer, f"add_sampling_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_file_without_keys_or_store_entry_gets_llama_servers_defaults(tmp_path):
    defaults = load_sampling_defaults(write_header(tmp_path / "mine.gguf"))
    assert values(defaults) == LLAMA_SERVER and defaults.sources == ()
    assert defaults == SamplingDefaults()


def test_the_store_entry_fills_what_it_names_and_llama_server_the_rest(tmp_path):
    defaults = load_sampling_defaults(write_header(tmp_path / QWEN_FILE))
    assert values(defaults) == (0.7, 20, 0.8, 0.05, 1.05, 64)
    assert defaults.source_of("top_k") == "the model store entry qwen2.5-coder-0.5b"
    assert defaults.source_of("min_p") == "llama-server's defaults"


def test_strata_generate_takes_the_models_defaults_for_the_flags_it_leaves_out(tmp_path):
    """`strata generate` resolves sampling as the server does: a flag given wins, the rest are the model's."""
    from api import cli

    args = cli._build_parser().parse_args(["generate", "--prompt", "hi", "--top-k", "3", "--stop", "END"])
    params = cli._generate_sampling(args, write_header(tmp_path / QWEN_FILE))
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty) == \
        (0.7, 3, 0.8, 0.05, 1.05)  # the store entry's but top_k, llama-server's min_p
    assert (params.presence_penalty, params.seed, params.stop, params.max_tokens) == (0.0, None, ("END",), 128)


def test_gguf_keys_win_over_the_store_entry_field_by_field(tmp_path):
    path = write_header(tmp_path / QWEN_FILE, temp=0.25, top_k=7, min_p=0.1, penalty_last_n=-1)
    defaults = load_sampling_defaults(path)
    assert values(defaults) == (0.25, 7, 0.8, 0.1, 1.05, -1)  # top_p and the penalty: the store entry's
    assert defaults.source_of("temperature") == defaults.source_of("repetition_last_n") \
        == "the GGUF's general.sampling keys"


def test_gguf_keys_win_over_llama_server_without_a_store_entry(tmp_path):
    path = write_header(tmp_path / "mine.gguf", temp=0.6, top_p=0.9, penalty_repeat=1.1, penalty_last_n=32)
    assert values(load_sampling_defaults(path)) == (0.6, 40, 0.9, 0.05, 1.1, 32)  # float32 in the file


def test_the_operators_temperature_wins_over_the_models(tmp_path):
    defaults = load_sampling_defaults(write_header(tmp_path / QWEN_FILE, temp=0.25), default_temperature=0.0)
    assert values(defaults) == (0.0, 20, 0.8, 0.05, 1.05, 64)
    assert defaults.source_of("temperature") == "--default-temperature"


def test_a_request_field_wins_over_every_default():
    defaults = SamplingDefaults(temperature=0.0, top_k=20, top_p=0.8, min_p=0.1, repetition_penalty=1.05)
    params = defaults.params(max_tokens=5, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty) == \
        (1.2, 0, 1.0, 0.0, 1.0)
    unset = defaults.params(max_tokens=5, seed=3)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p, unset.repetition_penalty, unset.seed) == \
        (0.0, 20, 0.8, 0.1, 1.05, 3)


def test_a_gguf_value_out_of_range_is_logged_and_the_next_source_used(caplog):
    caplog.set_level(logging.WARNING, logger="strata.serve")
    fields = {gguf.Keys.General.SAMPLING_TOP_P: 0.0, gguf.Keys.General.SAMPLING_TEMP: 0.3}
    defaults = resolve_sampling_defaults(fields, KNOWN_MODELS["qwen2.5-coder-0.5b"])
    assert (defaults.temperature, defaults.top_p) == (0.3, 0.8)
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring top_p 0.0 from the GGUF's general.sampling keys: top_p must be in (0, 1]"]


def test_mirostat_in_the_file_is_named_as_not_implemented(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="strata.serve")
    load_sampling_defaults(write_header(tmp_path / "mine.gguf", mirostat=2))
    assert "general.sampling.mirostat" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_every_store_entrys_sampling_resolves_to_its_own_values(name):
    entry = KNOWN_MODELS[name]
    defaults = resolve_sampling_defaults({}, entry)
    names = {"repeat_penalty": "repetition_penalty"}
    assert {names.get(k, k): getattr(defaults, names.get(k, k)) for k, _ in entry.sampling} == \
        {names.get(k, k): v for k, v in entry.sampling}


def test_the_start_up_line_names_the_values_and_where_they_came_from(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="strata.serve")
    load_sampling_defaults(write_header(tmp_path / QWEN_FILE))
    assert caplog.records[-1].getMessage() == (
        "sampling defaults for requests that set none: temperature 0.7 top_k 20 top_p 0.8 repetition_penalty 1.05 "
        "over the last 64 generated tokens (from the model store entry qwen2.5-coder-0.5b); min_p 0.05 (from "
        "llama-server's defaults)")


MODEL_DEFAULTS = SamplingDefaults(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.05)
EXPECTED = (0.7, 20, 0.8, 0.05, 1.05)


def sampled_with(params) -> tuple:
    return params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty


def test_chat_and_completions_without_sampling_fields_get_the_defaults():
    chat = parse_body(ChatCompletionRequest, orjson.dumps({"model": "m", "messages": [{"role": "user",
                                                                                       "content": "hi"}]}))
    completion = parse_body(CompletionRequest, orjson.dumps({"model": "m", "prompt": "hi"}))
    for body in (chat, completion):
        assert sampled_with(sampling_for(body.requested_sampling(), MODEL_DEFAULTS, None)(9)) == EXPECTED


def test_chat_takes_repetition_penalty_as_vllm_names_it():
    raw = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.3}
    body = parse_body(ChatCompletionRequest, orjson.dumps(raw))
    assert sampling_for(body.requested_sampling(), MODEL_DEFAULTS, None)(9).repetition_penalty == 1.3
    with pytest.raises(APIError) as refused:
        parse_body(ChatCompletionRequest, orjson.dumps({**raw, "repetition_penalty": 0}))
    assert (refused.value.status, refused.value.param) == (400, "repetition_penalty")


def test_messages_and_responses_without_sampling_fields_get_the_defaults():
    messages = MessagesRequest.model_validate({"model": "claude", "max_tokens": 9,
                                               "messages": [{"role": "user", "content": "hi"}]})
    responses = ResponsesRequest.model_validate({"input": "hi"})
    assert sampled_with(sampling_for(messages.requested_sampling(), MODEL_DEFAULTS, None)(9)) == EXPECTED
    assert sampled_with(sampling_for(responses.requested_sampling(), MODEL_DEFAULTS, None)(9)) == EXPECTED


@pytest.mark.parametrize(("prompt_len", "requested", "expected"), [
    (5000, None, 8192),  # Codex: no max_output_tokens, --default-max-tokens' 8192
    (30000, None, 32768 - 30000),  # ... clamped to the room
    (19000, 32000, 32768 - 19000),  # Claude Code's 32000 after its ~19K-token first prompt: the room
])
def test_the_reply_budget_without_max_tokens_is_8192_clamped_to_the_room(prompt_len, requested, expected):
    state = SimpleNamespace(ctx_size=32768, config=ServerConfig())
    assert fit_max_tokens(state, prompt_len, requested) == expected


def test_every_dialect_samples_with_the_models_defaults_through_a_server(tmp_path, caplog, monkeypatch):
    path = tmp_path / QWEN_FILE  # the store entry by name, two GGUF keys over it
    write_tiny_gguf(path, "qwen2", extra_metadata={"general.sampling.temp": 0.25, "general.sampling.top_k": 7})
    caplog.set_level(logging.INFO, logger="strata.serve")
    with running_server(open_model(str(path), fetch=False), ctx_size=256, batch=1) as (url, state):
        assert any(r.getMessage().startswith("sampling defaults for requests that set none: temperature 0.25 "
                                             "top_k 7 (from the GGUF") for r in caplog.records)
        submitted = []
        submit = state.engine.submit
        monkeypatch.setattr(state.engine, "submit", lambda request: submitted.append(request) or submit(request))
        user = [{"role": "user", "content": "hi"}]
        for route, body in [("/v1/chat/completions", {"model": state.served_name, "messages": user, "max_tokens": 2}),
                            ("/v1/completions", {"model": state.served_name, "prompt": "hi", "max_tokens": 2}),
                            ("/v1/messages", {"model": "claude", "messages": user, "max_tokens": 2}),
                            ("/v1/responses", {"input": "hi", "max_output_tokens": 2})]:
            reply = httpx.post(url + route, json=body, timeout=300)
            assert reply.status_code == 200, reply.text
        echo = reply.json()
    assert [sampled_with(r.params) for r in submitted] == [(0.25, 7, 0.8, 0.05, 1.05)] * 4
    assert (echo["temperature"], echo["top_p"]) == (0.25, 0.8)  # Responses repeats what applied
