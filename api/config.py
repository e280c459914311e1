"""`strata serve` configuration: one frozen ServerConfig from defaults, a JSON file, STRATA_* and flags.

Precedence, lowest first: field defaults < `--config FILE` (or $STRATA_CONFIG) < environment variables
`STRATA_<FIELD>` < command-line flags actually given. Every source is converted to the field's type here,
and every error is a ValueError naming where the bad value came from and what to change.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.config_checks import AUTO_CTX_CAP, MIN_CTX_SIZE, flag_name, validate_config
from engine.model_store import default_model_name

LOG_FORMATS = ("kv", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# auto: cuda when cuda-python, a driver and a device are there, else numpy (engine/loader.choose_backend).
BACKENDS = ("auto", "numpy", "cuda")
# How the numpy backend holds weights (engine/loader.CPU_WEIGHTS): the file's blocks or float32.
CPU_WEIGHTS = ("quantized", "quantized-int8act", "quantized-f32act", "f32")
# How K/V rows are stored (engine/kv.KV_TYPES); auto: the backend's default (numpy f32, cuda its first type).
KV_TYPE_CHOICES = ("auto", "f32", "f16", "int8")
# auto: picked from the chat template (api/tool_calls.detect_format); the names of api/tool_calls' registry.
TOOL_CALL_FORMATS = ("auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "generic", "generic_json",
                     "harmony")
# Where thinking text goes: vLLM's older field, its newer one, or left in content unparsed.
REASONING_FORMATS = ("reasoning_content", "reasoning", "none")
ENV_PREFIX = "STRATA_"
# Names the config file path, like --config; not a field, so it never reaches ServerConfig.
CONFIG_ENV = "STRATA_CONFIG"


def _opt(default: Any, help_text: str, choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"help": help_text, "choices": choices, "metavar": metavar})


@dataclass(frozen=True)
class ServerConfig:
    """Everything `strata serve` is told at start. Validated on construction, never mutated afterwards.

    Values found at start-up (the model path, the number of KV blocks) are not written back here; callers
    pass them on explicitly (see `public_model_name`).
    """

    model: str = _opt(default_model_name(), "model name (`strata pull --list` shows them), ollama:NAME[:TAG], "
                      "lmstudio:PUBLISHER/REPO, hf:OWNER/REPO[:QUANT], or path to a .gguf",
                      metavar="NAME|PATH")
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)", metavar="ADDR")
    port: int = _opt(8100, "TCP port to listen on (0 picks a free one)")
    batch: int = _opt(4, "number of slots: conversations decoded together")
    batch_groups: str = _opt("auto", "groups of slots that move through the pipeline stages staggered, so every "
                                     "stage has work (1..--batch, or auto: one per stage)", metavar="G|auto")
    layer_split: str = _opt("", "pipeline stages: the first layer of each stage after the first, e.g. 16,32 cuts "
                                "a 48-layer model into layers 0-15, 16-31, 32-47 (empty: one stage)",
                            metavar="L[,L...]")
    prefill_chunk: int = _opt(512, "most tokens of one prompt computed in one step (a step's cost: the running "
                                   "decodes wait that long for their next token)")
    # 2048: llama-server's -b, so four ~450-token agent prompts arriving together are read in one step as there.
    prefill_step_tokens: int = _opt(2048, "most prompt tokens of all prompts in one step: prompts that arrive "
                                          "together and fit are read together; a prompt that goes on is read "
                                          "alone, shortest first")
    max_queue: int = _opt(64, "requests allowed to wait for a slot; more get 503")
    ctx_size: int = _opt(0, f"tokens of context per slot (>= {MIN_CTX_SIZE}; 0: the model's trained context, "
                            f"at most {AUTO_CTX_CAP}, enough for an agent's first prompt)")
    # 8192, not the whole room: a small model that never writes its end token would otherwise fill a 32K context
    # (minutes of CPU) before Codex or a chat client without max_tokens saw a reply; 8192 still holds a
    # reasoning model's thinking plus a file-sized answer. Claude Code sends 32000 itself: clamped to the room.
    default_max_tokens: int = _opt(8192, "reply budget of a request that sets none (Codex sends none), clamped to "
                                         "the room its context leaves; 0: all that room, as llama-server's -n -1")
    default_temperature: float | None = _opt(None, "sampling temperature of a request that sets none (agents such "
                                                   "as Codex send none); unset: the model's (its GGUF's "
                                                   "general.sampling.temp, its store entry's, else llama-server's "
                                                   "0.8)", metavar="T")
    kv_cache_mib: str = _opt("0", "device KV pool in MiB: N (fixed; 0: enough for batch * ctx-size tokens), "
                                  "MIN:MAX (elastic, numpy: starts at MIN, grows to MAX as requests need room, "
                                  "shrinks on POST /cache/device-pool or SIGUSR1), or auto (sized from the "
                                  "machine's free memory, see docs/OPERATIONS.md)", metavar="N|MIN:MAX|auto")
    kv_cache_max_mib: int = _opt(0, "older spelling of --kv-cache-mib MIN:MAX's MAX (0: a fixed pool)")
    expert_cache_mib: str = _opt("", "MoE models on cuda: device MiB for hot experts, the rest in pinned host RAM "
                                     "(auto: as many as fit; unset: every expert on the device)", metavar="MIB|auto")
    kv_type: str = _opt("auto", "how K/V is stored: f32, f16, or int8 (one float32 scale per token and head; "
                                "about a quarter of f32's bytes); auto: the backend's default, f16 on numpy and "
                                "cuda", KV_TYPE_CHOICES)
    conversation_cache_mib: int = _opt(8192, "host RAM budget for parked conversation KV (0: none), clamped to "
                                             "what the machine has")
    conversation_cache_commit: str = _opt("on-demand", "when the host tier takes its RAM: on-demand (in segments, "
                                                       "as parks need it) or at-start (all of it, before serving)",
                                          ("on-demand", "at-start"))
    conversation_cache_min_free_mib: int = _opt(1024, "RAM always left to the rest of the machine")
    conversation_cache_dir: str | None = _opt(None, "folder for the disk tier; the cache then survives "
                                                    "restarts (unset: no disk tier)", metavar="DIR")
    conversation_cache_disk_mib: int = _opt(32768, "disk space the disk tier may use")
    conversation_cache_write_behind_mib_s: float = _opt(
        64.0, "disk tier: write computed blocks behind at up to this rate while serving, so a crash or kill -9 "
              "keeps every conversation but the last seconds' work (0: write only on spills and at shutdown)")
    conversation_active_s: float = _opt(300.0, "a conversation with a turn this recent keeps its cached blocks "
                                               "longer than one-off prompts' (0: plain least recently used)")
    state_checkpoint_every: str = _opt("auto", "hybrid models (lfm2, qwen3next): keep the recurrent state every N "
                                               "KV blocks of a long prompt, besides message starts, its end and each "
                                               "reply's end (0: only those; auto: N from the state's bytes, so states "
                                               "cost at most half the K/V between them)", metavar="N|auto")
    max_body_mib: float = _opt(16.0, "largest request body accepted, in MiB")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' (unset: no authentication); several "
                                     "comma-separated keys are tenants whose cached KV is never shared",
                               metavar="KEY[,KEY...]")
    served_model_name: str | None = _opt(None, "model id shown by the API (unset: the name its source gives it, "
                                                "else the model file's stem)",
                                         metavar="NAME")
    chat_template: str | None = _opt(None, "jinja file overriding the model's chat template", metavar="FILE")
    tool_call_format: str = _opt("auto", "how the model writes tool calls (auto: from the chat template; generic: "
                                         "the server describes the tools in the system prompt; generic_json: "
                                         "generic with every reply JSON, as llama.cpp does)", TOOL_CALL_FORMATS)
    tool_call_recovery: str = _opt("on", "with tool_choice auto, also take a tool call the model writes as a bare "
                                         "or ```json fenced JSON object naming a declared tool (Qwen2.5-Coder's "
                                         "habit), outside its format's markup (off: only the markup counts)",
                                   ("on", "off"))
    keep_reply_tokens: str = _opt("on", "a prompt that carries a reply this server generated, after the prompt it "
                                        "answered, takes the token ids the model generated for it instead of "
                                        "re-encoding its text, so the cache matches through the reply (off: "
                                        "every prompt encoded from its text)", ("on", "off"))
    reasoning_format: str = _opt("reasoning_content", "message field for a thinking model's reasoning text "
                                                      "(none: leave it in content)", REASONING_FORMATS)
    log_format: str = _opt("kv", "log line format", LOG_FORMATS)
    log_level: str = _opt("info", "lowest level logged", LOG_LEVELS)
    threads: int | None = _opt(None, "CPU threads for BLAS and the quantised-weight kernels (unset: all cores, "
                                     "shared out among pipeline stages)")
    backend: str = _opt("auto", "compute backend (auto: cuda when a GPU is usable, else numpy)", BACKENDS)
    cpu_weights: str = _opt("quantized", "how the numpy backend holds weights: quantized (the file's blocks, "
                                         "about a tenth of float32's memory, faster decode; decode products on "
                                         "int16-quantised activations), quantized-int8act (int8 ones, as "
                                         "llama.cpp), quantized-f32act (float32 ones) or f32 (dequantised at "
                                         "load, the reference)",
                                         CPU_WEIGHTS)
    shutdown_timeout_s: float = _opt(30.0, "on SIGTERM/Ctrl+C, seconds to finish in-flight requests before "
                                           "cancelling them")
    progress_interval_s: float = _opt(5.0, "seconds between progress lines of a long prefill")
    seed: int | None = _opt(None, "sampling seed for requests that give none (unset: random)")

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_mib, (int, float)) and not isinstance(self.kv_cache_mib, bool):
            object.__setattr__(self, "kv_cache_mib", str(self.kv_cache_mib))  # replace(cfg, kv_cache_mib=17)
        if isinstance(self.state_checkpoint_every, int) and not isinstance(self.state_checkpoint_every, bool):
            object.__setattr__(self, "state_checkpoint_every", str(self.state_checkpoint_every))
        validate_config(self)

    def as_log_dict(self) -> dict[str, Any]:
        """All fields as a dict for the start-up log line, with api_key shown as "***" when set."""
        values = dataclasses.asdict(self)
        if values["api_key"] is not None:
            values["api_key"] = "***"
        return values

    @property
    def layer_cuts(self) -> tuple[int, ...]:
        """--layer-split as integers (checked against the model's layer count at load)."""
        return tuple(int(v) for v in self.layer_split.split(",") if v.strip()) if self.layer_split else ()

    @property
    def kv_cache_range_mib(self) -> tuple[int, int] | None:
        """--kv-cache-mib (and the older --kv-cache-max-mib) as (MIN, MAX) MiB, MAX 0 for a fixed pool;
        None for auto (scheduler/memory/sizing.py)."""
        from scheduler.memory.sizing import parse_kv_cache_mib

        return parse_kv_cache_mib(self.kv_cache_mib, self.kv_cache_max_mib)

    @property
    def checkpoint_every_blocks(self) -> int | None:
        """--state-checkpoint-every as blocks; None for auto (resolved from the model's bytes at load,
        scheduler/checkpoint_spacing.py)."""
        value = self.state_checkpoint_every
        return None if value == "auto" else int(value)

    def groups_for(self, num_stages: int) -> int:
        """--batch-groups resolved: auto gives each stage a group of its own (at most --batch groups)."""
        if self.batch_groups == "auto":
            return min(self.batch, num_stages)
        return int(self.batch_groups)

    def public_model_name(self, model_path: str | os.PathLike[str]) -> str:
        """The model id the API shows: served_model_name, else the stem of the resolved model file."""
        return self.served_model_name or Path(model_path).stem


def env_name(name: str) -> str:
    """`prefill_chunk` -> `STRATA_PREFILL_CHUNK`."""
    return ENV_PREFIX + name.upper()


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds `--config` and one flag per ServerConfig field to `parser` (mutates it) and returns it.

    Flags default to argparse.SUPPRESS, so the parsed namespace holds only the flags actually given, which
    is what lets them override the file and the environment. Values stay strings until `config_from_args`.
    """
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help=f"JSON file whose keys are these flags' names (default: ${CONFIG_ENV})")
    for f in dataclasses.fields(ServerConfig):
        shown = "" if f.default is None else f"default: {f.default}; "
        parser.add_argument(flag_name(f.name), dest=f.name, default=argparse.SUPPRESS, metavar=_metavar(f),
                            help=f"{f.metadata['help']} ({shown}env {env_name(f.name)})")
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
    for name in _FIELD_TYPES:
        if env_name(name) in environ:  # unrelated STRATA_* variables (STRATA_HOME) are never looked at
            values[name] = _convert(name, environ[env_name(name)], env_name(name))
    for name in _FIELD_TYPES:
        if hasattr(args, name):
            values[name] = _convert(name, getattr(args, name), flag_name(name))
    return ServerConfig(**values)


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
        if name not in _FIELD_TYPES:
            valid = ", ".join(_FIELD_TYPES)
            raise ValueError(f"{source}: unknown key {key!r}; valid keys are: {valid}")
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


def _field_types() -> dict[str, tuple[type, bool]]:
    """Field name -> (base type, accepts None), read from the annotations so they cannot drift."""
    hints = typing.get_type_hints(ServerConfig)
    result = {}
    for f in dataclasses.fields(ServerConfig):
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):
            base = [a for a in typing.get_args(hint) if a is not type(None)]
            result[f.name] = (base[0], True)
        else:
            result[f.name] = (hint, False)
    return result


_FIELD_TYPES = _field_types()


def _convert(name: str, raw: Any, source: str) -> Any:
    """Converts a string (flag, env) or JSON value to the field's type; "" or null means None where allowed."""
    kind, nullable = _FIELD_TYPES[name]
    if name in _JSON_LIST_OR_INT and isinstance(raw, (list, int)) and not isinstance(raw, bool):
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
    choices = ServerConfig.__dataclass_fields__[name].metadata["choices"]
    return value.lower() if choices or name in ("batch_groups", "state_checkpoint_every") else value


_JSON_LIST_OR_INT = ("layer_split", "batch_groups", "kv_cache_mib", "state_checkpoint_every")
_KIND_WORDS = {int: "an integer", float: "a number", str: "a string"}


def _metavar(f: dataclasses.Field) -> str:
    if f.metadata["choices"]:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    return f.metadata["metavar"] or {int: "N", float: "X"}.get(_FIELD_TYPES[f.name][0], "TEXT")
