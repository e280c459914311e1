"""ServerConfig: defaults < config file < STRATA_* environment < flags, typed, validated, secrets hidden."""
import argparse
import json
import re
from pathlib import Path

import pydantic
import pytest

from api.config import ServerConfig
from api.config_load import add_serve_arguments, config_from_args, load_config, read_config_file

REPO = Path(__file__).resolve().parent.parent


def write_config(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_defaults_without_any_source():
    cfg = load_config([], environ={})
    assert cfg == ServerConfig()
    assert (cfg.model, cfg.host, cfg.port, cfg.batch, cfg.ctx_size) == ("qwen2.5-coder-0.5b", "127.0.0.1", 8100, 4, 0)
    assert cfg.api_key is None and cfg.threads is None and cfg.seed is None


def test_file_overrides_defaults(tmp_path):
    cfg = load_config(["--config", write_config(tmp_path, {"port": 9001, "max_body_mib": 2})], environ={})
    assert cfg.port == 9001
    assert cfg.max_body_mib == 2.0 and isinstance(cfg.max_body_mib, float)


def test_env_overrides_file(tmp_path):
    path = write_config(tmp_path, {"port": 9001, "batch": 2})
    cfg = load_config(["--config", path], environ={"STRATA_PORT": "9002"})
    assert (cfg.port, cfg.batch) == (9002, 2)


def test_flags_override_env_and_file(tmp_path):
    path = write_config(tmp_path, {"port": 9001, "batch": 2, "ctx_size": 64})
    cfg = load_config(["--config", path, "--port", "9003"], environ={"STRATA_PORT": "9002", "STRATA_BATCH": "3"})
    assert (cfg.port, cfg.batch, cfg.ctx_size) == (9003, 3, 64)


def test_file_accepts_dash_and_underscore_keys(tmp_path):
    path = write_config(tmp_path, {"prefill-chunk": 128, "max_queue": 5, "shutdown-timeout-s": 2.5})
    cfg = load_config(["--config", path], environ={})
    assert (cfg.prefill_chunk, cfg.max_queue, cfg.shutdown_timeout_s) == (128, 5, 2.5)


def test_file_key_given_both_ways_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="given twice"):
        read_config_file(write_config(tmp_path, {"prefill-chunk": 128, "prefill_chunk": 64}))


def test_unknown_file_key_names_it_and_lists_valid_keys(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'prefil_chunk'.*valid keys are: .*prefill_chunk"):
        load_config(["--config", write_config(tmp_path, {"prefil_chunk": 1})], environ={})


def test_wrong_type_in_file_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"key 'batch': 2.5 is not an integer"):
        read_config_file(write_config(tmp_path, {"batch": 2.5}))
    with pytest.raises(ValueError, match=r"key 'model': 5 is not a string"):
        read_config_file(write_config(tmp_path, {"model": 5}))


def test_numbers_written_as_strings_in_the_file_are_converted(tmp_path):
    assert read_config_file(write_config(tmp_path, {"port": "8101"})) == {"port": 8101}


def test_invalid_json_says_where(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON at line 2"):
        read_config_file(write_config(tmp_path, '{\n  "port": ,\n}'))


def test_missing_config_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_config(["--config", str(tmp_path / "absent.json")], environ={})


def test_strata_config_env_names_the_file(tmp_path):
    cfg = load_config([], environ={"STRATA_CONFIG": write_config(tmp_path, {"batch": 7})})
    assert cfg.batch == 7


def test_env_values_are_typed():
    env = {"STRATA_PREFILL_CHUNK": "256", "STRATA_MAX_BODY_MIB": "0.5", "STRATA_THREADS": "2",
           "STRATA_LOG_LEVEL": "DEBUG", "STRATA_API_KEY": "sk-1"}
    cfg = load_config([], environ=env)
    assert (cfg.prefill_chunk, cfg.max_body_mib, cfg.threads) == (256, 0.5, 2)
    assert (cfg.log_level, cfg.api_key) == ("debug", "sk-1")


def test_empty_env_value_unsets_an_optional_field(tmp_path):
    path = write_config(tmp_path, {"seed": 5})
    assert load_config(["--config", path], environ={"STRATA_SEED": ""}).seed is None


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="STRATA_BATCH: 'four' is not an integer"):
        load_config([], environ={"STRATA_BATCH": "four"})


def test_non_field_strata_variables_are_ignored():
    cfg = load_config([], environ={"STRATA_HOME": "/somewhere", "STRATA_DEFAULT_MODEL": "x"})
    assert cfg == ServerConfig()


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ValueError, match="--max-body-mib: 'big' is not a number"):
        load_config(["--max-body-mib", "big"], environ={})


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--port", "70000"], "--port 70000 is out of range"),
    (["--ctx-size", "8"], "--ctx-size must be 0 (auto) or >= 16"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--kv-cache-mib", "-5"], "--kv-cache-mib must be >= 0"),
    (["--max-body-mib", "0"], "--max-body-mib must be a number > 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--shutdown-timeout-s", "-1"], "--shutdown-timeout-s must be a number >= 0"),
    (["--progress-interval-s", "nan"], "--progress-interval-s must be a number > 0"),
    (["--seed", "-3"], "--seed must be in"),
    (["--log-format", "xml"], "--log-format 'xml' is not one of: kv, json"),
    (["--backend", "tpu"], "--backend 'tpu' is not one of"),
    (["--model", ""], "--model must not be empty"),
])
def test_validation_error_names_the_flag(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(argv, environ={})


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="--batch must be >= 1"):
        ServerConfig(batch=0)


def test_config_is_frozen():
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        ServerConfig().port = 1


def test_as_log_dict_hides_the_api_key():
    logged = ServerConfig(api_key="sk-secret").as_log_dict()
    assert logged["api_key"] == "***" and "sk-secret" not in json.dumps(logged)
    assert ServerConfig().as_log_dict()["api_key"] is None
    assert set(logged) == set(ServerConfig.model_fields)


def test_public_model_name_defaults_to_the_file_stem():
    path = "/cache/models/SmolLM2-135M-Instruct-Q4_1.gguf"
    assert ServerConfig().public_model_name(path) == "SmolLM2-135M-Instruct-Q4_1"
    assert ServerConfig(served_model_name="smol").public_model_name("/x/y.gguf") == "smol"


def test_serve_flags_attach_to_a_cli_subparser():
    parser = argparse.ArgumentParser(prog="strata")
    parser.add_argument("-v", "--verbose", action="store_true")
    serve = parser.add_subparsers().add_parser("serve")
    add_serve_arguments(serve)
    args = parser.parse_args(["-v", "serve", "--batch", "2"])
    assert config_from_args(args, environ={}).batch == 2


def test_operations_doc_example_has_every_key_and_loads(tmp_path):
    doc = (REPO / "docs" / "OPERATIONS.md").read_text()
    example = re.search(r"```json\n(\{.*?\})\n```", doc, re.S).group(1)
    keys = {k.replace("-", "_") for k in json.loads(example)}
    assert keys == set(ServerConfig.model_fields)
    assert load_config(["--config", write_config(tmp_path, example)], environ={}) == ServerConfig()


@pytest.mark.parametrize(("argv", "expected"), [
    ([], (0, 0)),
    (["--kv-cache-mib", "2048"], (2048, 0)),
    (["--kv-cache-mib", "1024:8192"], (1024, 8192)),
    (["--kv-cache-mib", "0:512"], (0, 512)),
    (["--kv-cache-mib", "1024", "--kv-cache-max-mib", "8192"], (1024, 8192)),  # the older spelling
    (["--kv-cache-mib", "AUTO"], None),
])
def test_kv_cache_mib_takes_a_size_a_range_or_auto(argv, expected):
    assert load_config(argv, environ={}).kv_cache_range_mib == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-cache-mib", "big"], "is not MiB, MIN:MAX or auto"),
    (["--kv-cache-mib", "4096:1024"], "MAX is below MIN"),
    (["--kv-cache-mib", "1:2", "--kv-cache-max-mib", "3"], "give the maximum once"),
    (["--kv-cache-mib", "auto", "--kv-cache-max-mib", "3"], "drop --kv-cache-max-mib"),
])
def test_a_bad_kv_cache_mib_says_what_to_write(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(argv, environ={})


def test_kv_cache_mib_from_a_file_may_be_a_number_or_a_range(tmp_path):
    assert load_config(["--config", write_config(tmp_path, '{"kv-cache-mib": 17}')], environ={}).kv_cache_mib == "17"
    assert ServerConfig(kv_cache_mib=17).kv_cache_range_mib == (17, 0)  # ServerConfig.replace in the tests
    cfg = load_config(["--config", write_config(tmp_path, '{"kv_cache_mib": "64:256"}')], environ={})
    assert cfg.kv_cache_range_mib == (64, 256)
