"""Where `strata serve`'s settings come from: defaults < a JSON file < STRATA_* environment < flags.

The file is `--config FILE` (or $STRATA_CONFIG); the environment is read through pydantic-settings'
environment source (ServerConfig's prefix, names matched without regard to case, so unrelated STRATA_*
variables such as STRATA_HOME are never looked at); flags are the ones actually given. Every value is
converted to its field's type here, with an error naming the key, variable or flag it came from; the limits
are then ServerConfig's own (api/config.py).
"""
from __future__ import annotations

import argparse
import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic_settings import EnvSettingsSource

from api.config import ServerConfig
from api.config_checks import choices_of, flag_name

CONFIG_ENV = "STRATA_CONFIG"  # names the config file path, like --config; not a field
_FIELDS = ServerConfig.model_fields
_KIND_WORDS = {int: "an integer", float: "a number", str: "a string"}
_TEXT_OR_NUMBER = ("layer_split", "batch_groups", "kv_cache_mib", "state_checkpoint_every")  # "layer_split": [16, 32]
_LOWER_CASED = ("batch_groups", "state_checkpoint_every")  # besides the fields with choices: AUTO is auto


def env_name(name: str) -> str:
    """`prefill_chunk` -> `STRATA_PREFILL_CHUNK`."""
    return ServerConfig.model_config["env_prefix"] + name.upper()


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds `--config` and one flag per ServerConfig field to `parser` (mutates it) and returns it.

    Flags default to argparse.SUPPRESS, so the parsed namespace holds only the flags actually given, which
    is what lets them override the file and the environment. Values stay strings until `config_from_args`.
    """
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help=f"JSON file whose keys are these flags' names (default: ${CONFIG_ENV})")
    for name, field in _FIELDS.items():
        shown = "" if field.default is None else f"default: {field.default}; "
        parser.add_argument(flag_name(name), dest=name, default=argparse.SUPPRESS, metavar=_metavar(name),
                            help=f"{field.description} ({shown}env {env_name(name)})")
    return parser


def build_arg_parser() -> argparse.ArgumentParser:
    """A stand-alone parser with the `serve` flags (the CLI attaches the same flags to its subcommand)."""
    parser = argparse.ArgumentParser(prog="strata serve", description="OpenAI-compatible server for a GGUF model")
    return add_serve_arguments(parser)


def load_config(argv: list[str] | None, environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """Parses `argv` (None: sys.argv[1:]) and merges it with the config file and `environ`."""
    return config_from_args(build_arg_parser().parse_args(argv), environ)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """Builds the ServerConfig from a namespace parsed by a parser that `add_serve_arguments` set up.

    Other attributes of the namespace (the CLI's own options) are ignored.
    """
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None) or environ.get(CONFIG_ENV) or None
    if config_path:
        values.update(read_config_file(config_path))
    for name, raw in environment_values(environ).items():
        values[name] = _convert(name, raw, env_name(name))
    for name in _FIELDS:
        if hasattr(args, name):
            values[name] = _convert(name, getattr(args, name), flag_name(name))
    return ServerConfig(**values)


def environment_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The STRATA_<FIELD> variables in ``environ``, by field name, as text (pydantic-settings' source)."""
    source = EnvSettingsSource(ServerConfig)
    source.env_vars = {key.lower(): value for key, value in environ.items()}  # this mapping, not os.environ
    return {name: value for name, value in source().items() if name in _FIELDS}


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a JSON object of field values; keys are field names ("prefill_chunk") or flag names
    ("prefill-chunk"). Returns them by field name, typed. Raises ValueError on any bad key or value."""
    source = f"--config {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{source}: cannot read the file ({exc.strerror or exc})") from exc
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object of settings, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            raise ValueError(f"{source}: unknown key {key!r}; valid keys are: {', '.join(_FIELDS)}")
        if name in values:
            raise ValueError(f"{source}: {key!r} is given twice (with '-' and with '_'); keep one")
        values[name] = _convert(name, raw, f"{source}: key {key!r}")
    return values


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"duplicate keys in the config file: {', '.join(repeated)}")
    return dict(pairs)


def _field_type(name: str) -> tuple[type, bool]:
    """(base type, accepts None) of a field, read from its annotation so they cannot drift."""
    annotation = _FIELDS[name].annotation
    if choices_of(_FIELDS[name]):
        return str, False
    args = typing.get_args(annotation)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return annotation, False


def _convert(name: str, raw: Any, source: str) -> Any:
    """Converts a string (flag, env) or JSON value to the field's type; "" or null means None where allowed."""
    kind, nullable = _field_type(name)
    if name in _TEXT_OR_NUMBER and isinstance(raw, (list, int)) and not isinstance(raw, bool):
        raw = ",".join(str(v) for v in raw) if isinstance(raw, list) else str(raw)  # "layer_split": [16, 32]
    if raw is None or (nullable and raw == ""):
        if nullable:
            return None
        raise ValueError(f"{source}: needs a value, {name} cannot be null")
    if isinstance(raw, str):
        raw = raw.strip()
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{source}: {raw!r} is not {_KIND_WORDS[kind]}") from None
    elif kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, kind) and not isinstance(raw, bool):
        value = raw
    else:
        raise ValueError(f"{source}: {raw!r} is not {_KIND_WORDS[kind]}")
    return value.lower() if choices_of(_FIELDS[name]) or name in _LOWER_CASED else value


def _metavar(name: str) -> str:
    choices = choices_of(_FIELDS[name])
    if choices:
        return "{" + ",".join(choices) + "}"
    extra = _FIELDS[name].json_schema_extra
    return extra.get("metavar") or {int: "N", float: "X"}.get(_field_type(name)[0], "TEXT")
