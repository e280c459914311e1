"""`strata serve` configuration: one frozen ServerConfig, a pydantic model whose fields declare their limits.

Each field's limits (``ge``, ``gt``, ``min_length``) and choices (``Literal``, from the module that owns the
list) are checked by pydantic on construction; what a bound cannot say is in api/config_checks.py, which also
words every error as a sentence naming the flag. Where values come from (defaults < `--config FILE` <
STRATA_* environment < flags) is api/config_load.py's business: constructing a ServerConfig reads no source.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.config_checks import (AUTO_CTX_CAP, MIN_CTX_SIZE, check_batch_groups, check_checkpoint_every, check_ctx_size,
                               check_expert_cache_mib, check_kv_cache_mib, check_layer_split, explain)
from api.logging_setup import LOG_FORMATS, LOG_LEVELS
from api.tool_calls.registry import FORMATS
from engine.generate import PREFILL_CHUNK
from engine.kv import KV_TYPES
from engine.loader import BACKEND_NAMES, CPU_WEIGHTS
from engine.model_store import default_model_name
from scheduler.cache.conversation_activity import ACTIVE_WINDOW_S
from scheduler.output import PROGRESS_INTERVAL_S

# auto: the backend's default (numpy f16, cuda its first type)
KV_TYPE_CHOICES = ("auto", *KV_TYPES)
# auto: picked from the chat template (api/tool_calls.detect_format)
TOOL_CALL_FORMATS = ("auto", *FORMATS)
# Where thinking text goes: vLLM's older field, its newer one, or left in content unparsed.
REASONING_FORMATS = ("reasoning_content", "reasoning", "none")
ENV_PREFIX = "STRATA_"


def _opt(default: Any, help_text: str, *, metavar: str | None = None, hint: str | None = None,
         message: str | None = None, **limits: Any) -> Any:
    """A field: its default, help, limits; ``hint`` ends a limit's error, ``message`` replaces it."""
    return Field(default, description=help_text, json_schema_extra={"metavar": metavar, "hint": hint,
                                                                    "message": message}, **limits)


class ServerConfig(BaseSettings):
    """Everything `strata serve` is told at start. Validated on construction (a ValueError naming the flag),
    never mutated afterwards (``replace`` makes a validated copy).

    Values found at start-up (the model path, the number of KV blocks) are not written back here; callers
    pass them on explicitly (see `public_model_name`).
    """

    model_config = SettingsConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, env_prefix=ENV_PREFIX,
                                      case_sensitive=False)

    model: str = _opt(default_model_name(), "model name (`strata pull --list` shows them), ollama:NAME[:TAG], "
                      "lmstudio:PUBLISHER/REPO, hf:OWNER/REPO[:QUANT], or path to a .gguf", metavar="NAME|PATH",
                      min_length=1)
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)", metavar="ADDR", min_length=1)
    port: int = _opt(8100, "TCP port to listen on (0 picks a free one)", ge=0, le=65535,
                     message="--port {value} is out of range; use 1-65535 (or 0 for a free port)")
    batch: int = _opt(4, "number of slots: conversations decoded together", ge=1)
    batch_groups: str = _opt("auto", "groups of slots that move through the pipeline stages staggered, so every "
                             "stage has work (1..--batch, or auto: one per stage)", metavar="G|auto")
    layer_split: Annotated[str, AfterValidator(check_layer_split)] = _opt(
        "", "pipeline stages: the first layer of each stage after the first, e.g. 16,32 cuts a 48-layer model into "
        "layers 0-15, 16-31, 32-47 (empty: one stage)", metavar="L[,L...]")
    prefill_chunk: int = _opt(PREFILL_CHUNK, "most tokens of one prompt computed in one step (a step's cost: the "
                              "running decodes wait that long for their next token)", ge=1)
    # 2048: llama-server's -b, so four ~450-token agent prompts arriving together are read in one step as there.
    prefill_step_tokens: int = _opt(2048, "most prompt tokens of all prompts in one step: prompts that arrive "
                                    "together and fit are read together; a prompt that goes on is read alone, "
                                    "shortest first", ge=1)
    max_queue: int = _opt(64, "requests allowed to wait for a slot; more get 503", ge=0,
                          hint="0 rejects requests when every slot is busy")
    ctx_size: Annotated[int, AfterValidator(check_ctx_size)] = _opt(
        0, f"tokens of context per slot (>= {MIN_CTX_SIZE}; 0: the model's trained context, at most {AUTO_CTX_CAP}, "
        "enough for an agent's first prompt)")
    # 8192, not the whole room: a small model that never writes its end token would otherwise fill a 32K context
    # (minutes of CPU) before Codex or a chat client without max_tokens saw a reply; 8192 still holds a
    # reasoning model's thinking plus a file-sized answer. Claude Code sends 32000 itself: clamped to the room.
    default_max_tokens: int = _opt(8192, "reply budget of a request that sets none (Codex sends none), clamped to "
                                   "the room its context leaves; 0: all that room, as llama-server's -n -1", ge=0,
                                   hint="0 gives a reply all the room its context leaves")
    default_temperature: float | None = _opt(None, "sampling temperature of a request that sets none (agents such "
                                             "as Codex send none); unset: the model's (its GGUF's "
                                             "general.sampling.temp, its store entry's, else llama-server's 0.8)",
                                             metavar="T", ge=0.0, le=2.0)
    kv_cache_mib: Annotated[str, AfterValidator(check_kv_cache_mib)] = _opt(
        "0", "device KV pool in MiB: N (fixed; 0: enough for batch * ctx-size tokens), MIN:MAX (elastic, numpy: "
        "starts at MIN, grows to MAX as requests need room, shrinks on POST /cache/device-pool or SIGUSR1), or auto "
        "(sized from the machine's free memory, see docs/OPERATIONS.md)", metavar="N|MIN:MAX|auto")
    kv_cache_max_mib: int = _opt(0, "older spelling of --kv-cache-mib MIN:MAX's MAX (0: a fixed pool)", ge=0)
    expert_cache_mib: Annotated[str, AfterValidator(check_expert_cache_mib)] = _opt(
        "", "MoE models on cuda: device MiB for hot experts, the rest in pinned host RAM (auto: as many as fit; "
        "unset: every expert on the device)", metavar="MIB|auto")
    kv_type: Literal[KV_TYPE_CHOICES] = _opt("auto", "how K/V is stored: f32, f16, or int8 (one float32 scale per "
                                             "token and head; about a quarter of f32's bytes); auto: the "
                                             "backend's default, f16 on numpy and cuda")
    conversation_cache_mib: float = _opt(8192, "host RAM budget for parked conversation KV (0: none), clamped to "
                                       "what the machine has", ge=0)
    conversation_cache_commit: Literal["on-demand", "at-start"] = _opt(
        "on-demand", "when the host tier takes its RAM: on-demand (in segments, as parks need it) or at-start (all "
        "of it, before serving)")
    conversation_cache_min_free_mib: int = _opt(1024, "RAM always left to the rest of the machine", ge=0)
    conversation_cache_dir: str | None = _opt(None, "folder for the disk tier; the cache then survives restarts "
                                              "(unset: no disk tier)", metavar="DIR", min_length=1)
    conversation_cache_disk_mib: int = _opt(32768, "disk space the disk tier may use", ge=0)
    conversation_cache_write_behind_mib_s: float = _opt(
        64.0, "disk tier: write computed blocks behind at up to this rate while serving, so a crash or kill -9 "
        "keeps every conversation but the last seconds' work (0: write only on spills and at shutdown)", ge=0.0)
    conversation_active_s: float = _opt(ACTIVE_WINDOW_S, "a conversation with a turn this recent keeps its cached blocks "
                                        "longer than one-off prompts' (0: plain least recently used)", ge=0.0,
                                        hint="0 turns it off")
    state_checkpoint_every: Annotated[str, AfterValidator(check_checkpoint_every)] = _opt(
        "auto", "hybrid models (lfm2, qwen3next): keep the recurrent state every N KV blocks of a long prompt, "
        "besides message starts, its end and each reply's end (0: only those; auto: N from the state's bytes, so "
        "states cost at most half the K/V between them)", metavar="N|auto")
    max_body_mib: float = _opt(16.0, "largest request body accepted, in MiB", gt=0.0)
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' (unset: no authentication); several "
                               "comma-separated keys are tenants whose cached KV is never shared",
                               metavar="KEY[,KEY...]", min_length=1)
    served_model_name: str | None = _opt(None, "model id shown by the API (unset: the name its source gives it, "
                                         "else the model file's stem)", metavar="NAME", min_length=1)
    chat_template: str | None = _opt(None, "jinja file overriding the model's chat template", metavar="FILE",
                                     min_length=1)
    tool_call_format: Literal[TOOL_CALL_FORMATS] = _opt(
        "auto", "how the model writes tool calls (auto: from the chat template; generic: the server describes the "
        "tools in the system prompt; generic_json: generic with every reply JSON, as llama.cpp does)")
    tool_call_recovery: Literal["on", "off"] = _opt(
        "on", "with tool_choice auto, also take a tool call the model writes as a bare or ```json fenced JSON "
        "object naming a declared tool (Qwen2.5-Coder's habit), outside its format's markup (off: only the markup "
        "counts)")
    keep_reply_tokens: Literal["on", "off"] = _opt(
        "on", "a prompt that carries a reply this server generated, after the prompt it answered, takes the token "
        "ids the model generated for it instead of re-encoding its text, so the cache matches through the reply "
        "(off: every prompt encoded from its text)")
    reasoning_format: Literal[REASONING_FORMATS] = _opt("reasoning_content", "message field for a thinking "
                                                        "model's reasoning text (none: leave it in content)")
    log_format: Literal[LOG_FORMATS] = _opt("kv", "log line format")
    log_level: Literal[LOG_LEVELS] = _opt("info", "lowest level logged")
    threads: int | None = _opt(None, "CPU threads for BLAS and the quantised-weight kernels (unset: all cores, "
                               "shared out among pipeline stages)", ge=1, hint="unset uses every core")
    backend: Literal[BACKEND_NAMES] = _opt("auto", "compute backend (auto: cuda when a GPU is usable, else numpy)")
    cpu_weights: Literal[CPU_WEIGHTS] = _opt(
        "quantized", "how the numpy backend holds weights: quantized (the file's blocks, about a tenth of float32's "
        "memory, faster decode; decode products on int16-quantised activations), quantized-int8act (int8 ones, as "
        "llama.cpp), quantized-f32act (float32 ones) or f32 (dequantised at load, the reference)")
    shutdown_timeout_s: float = _opt(30.0, "on SIGTERM/Ctrl+C, seconds to finish in-flight requests before "
                                     "cancelling them", ge=0.0)
    progress_interval_s: float = _opt(PROGRESS_INTERVAL_S, "seconds between progress lines of a long prefill", gt=0.0)
    seed: int | None = _opt(None, "sampling seed for requests that give none (unset: random)", ge=0, lt=2**64,
                            message="--seed must be in 0..2**64-1 (got {value})")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ValueError(explain(exc, type(self).model_fields)) from None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """Only what the caller gives: api/config_load.py reads the file, the environment and the flags (and
        names the one a bad value came from)."""
        return (init_settings,)

    @field_validator("kv_cache_mib", "state_checkpoint_every", "batch_groups", mode="before")
    @classmethod
    def _number_as_text(cls, value: Any) -> Any:  # replace(kv_cache_mib=17), a JSON file's 17
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check_across_fields(self) -> "ServerConfig":
        check_batch_groups(self.batch_groups, self.batch)
        self.kv_cache_range_mib  # noqa: B018 -- raises a ValueError naming the flag on a bad N, MIN:MAX or auto
        return self

    def replace(self, **changes: Any) -> "ServerConfig":
        """A copy with ``changes``, validated as a new config is."""
        return type(self)(**{**self.model_dump(), **changes})

    def as_log_dict(self) -> dict[str, Any]:
        """All fields as a dict for the start-up log line, with api_key shown as "***" when set."""
        values = self.model_dump()
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
        scheduler/cache/checkpoint_spacing.py)."""
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
