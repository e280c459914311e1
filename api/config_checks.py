"""The checks every ServerConfig passes on construction (api/config.py): each failure is a ValueError naming
the flag and what to change, so a bad value from a file, the environment or the command line reads the same."""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from api.config import ServerConfig

MIN_CTX_SIZE = 16
# --ctx-size 0 takes the model's trained context up to this: Claude Code's first prompt is ~19K tokens, and
# a 128K-262K context per slot would size the K/V pool for prompts agents on this hardware never send.
AUTO_CTX_CAP = 32768


def resolve_ctx_size(ctx_size: int, trained_context: int) -> int:
    """Tokens of context per slot: ``ctx_size`` as given, or for 0 the trained context capped at AUTO_CTX_CAP."""
    return ctx_size or min(trained_context, AUTO_CTX_CAP)


def flag_name(name: str) -> str:
    """`prefill_chunk` -> `--prefill-chunk`."""
    return "--" + name.replace("_", "-")


def validate_config(cfg: "ServerConfig") -> None:
    """Raises ValueError naming the flag and what to change. Called on every construction."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    for name in ("model", "host"):
        need(bool(getattr(cfg, name)), f"{flag_name(name)} must not be empty")
    need(0 <= cfg.port <= 65535, f"--port {cfg.port} is out of range; use 1-65535 (or 0 for a free port)")
    need(cfg.batch >= 1, f"--batch must be >= 1 (got {cfg.batch})")
    groups = cfg.batch_groups
    need(groups == "auto" or (groups.isdigit() and 1 <= int(groups) <= cfg.batch),
         f"--batch-groups must be auto or 1..--batch ({cfg.batch}) (got {groups!r})")
    try:
        cuts = cfg.layer_cuts
    except ValueError:
        cuts = None
    need(cuts is not None and all(c > 0 for c in cuts) and list(cuts) == sorted(set(cuts)),
         f"--layer-split {cfg.layer_split!r} must be strictly increasing layer numbers > 0, e.g. 16,32")
    need(cfg.prefill_chunk >= 1, f"--prefill-chunk must be >= 1 (got {cfg.prefill_chunk})")
    need(cfg.prefill_step_tokens >= 1, f"--prefill-step-tokens must be >= 1 (got {cfg.prefill_step_tokens})")
    need(cfg.max_queue >= 0,
         f"--max-queue must be >= 0 (got {cfg.max_queue}; 0 rejects requests when every slot is busy)")
    need(cfg.ctx_size == 0 or cfg.ctx_size >= MIN_CTX_SIZE,
         f"--ctx-size must be 0 (auto) or >= {MIN_CTX_SIZE} (got {cfg.ctx_size})")
    need(cfg.kv_cache_max_mib >= 0, f"--kv-cache-max-mib must be >= 0 (got {cfg.kv_cache_max_mib})")
    need(cfg.default_temperature is None or 0.0 <= cfg.default_temperature <= 2.0,
         f"--default-temperature must be in 0..2 (got {cfg.default_temperature})")
    need(cfg.default_max_tokens >= 0, f"--default-max-tokens must be >= 0 (got {cfg.default_max_tokens}; 0 gives a "
         f"reply all the room its context leaves)")
    need(not cfg.kv_cache_mib.startswith("-"),
         f"--kv-cache-mib must be >= 0 (got {cfg.kv_cache_mib}; 0 sizes it from --batch * --ctx-size)")
    need(cfg.expert_cache_mib in ("", "auto") or re.fullmatch(r"\d+(\.\d+)?", cfg.expert_cache_mib) is not None
         and float(cfg.expert_cache_mib) > 0, f"--expert-cache-mib takes a MiB count > 0 or auto (got "
         f"{cfg.expert_cache_mib!r})")
    cfg.kv_cache_range_mib  # noqa: B018 -- raises a ValueError naming the flag on a bad N, MIN:MAX or auto
    every = cfg.state_checkpoint_every
    need(isinstance(every, str) and (every == "auto" or re.fullmatch(r"\d+", every) is not None),
         f"--state-checkpoint-every must be auto or a whole number of KV blocks >= 0 (got {every!r}; 0 keeps "
         f"only message starts, prompt and reply ends)")
    for name in ("conversation_cache_mib", "conversation_cache_min_free_mib", "conversation_cache_disk_mib",
                 "conversation_cache_write_behind_mib_s"):
        need(getattr(cfg, name) >= 0, f"{flag_name(name)} must be >= 0 (got {getattr(cfg, name)})")
    for name in ("max_body_mib", "progress_interval_s"):
        value = getattr(cfg, name)
        need(math.isfinite(value) and value > 0, f"{flag_name(name)} must be a number > 0 (got {value})")
    need(math.isfinite(cfg.conversation_active_s) and cfg.conversation_active_s >= 0,
         f"--conversation-active-s must be a number >= 0 (got {cfg.conversation_active_s}; 0 turns it off)")
    need(math.isfinite(cfg.shutdown_timeout_s) and cfg.shutdown_timeout_s >= 0,
         f"--shutdown-timeout-s must be a number >= 0 (got {cfg.shutdown_timeout_s})")
    for name in ("api_key", "served_model_name", "chat_template", "conversation_cache_dir"):
        need(getattr(cfg, name) != "", f"{flag_name(name)} must not be empty; leave it unset instead")
    need(cfg.threads is None or cfg.threads >= 1, f"--threads must be >= 1 (got {cfg.threads}; unset uses every core)")
    need(cfg.seed is None or 0 <= cfg.seed < 2**64, f"--seed must be in 0..2**64-1 (got {cfg.seed})")
    for name in ("log_format", "log_level", "backend", "cpu_weights", "kv_type"):
        choices = type(cfg).__dataclass_fields__[name].metadata["choices"]
        value = getattr(cfg, name)
        need(value in choices, f"{flag_name(name)} {value!r} is not one of: {', '.join(choices)}")
