"""What ServerConfig's declared limits cannot say, and its errors in words that name the flag.

The limits and choices themselves are declared on the fields (api/config.py: ``ge``, ``gt``, ``Literal``);
pydantic checks them. This module holds the checks that are more than a bound (a size that is N, MIN:MAX or
auto; increasing layer numbers) and ``explain``, which turns pydantic's first error into a sentence naming
the flag and what to change, so a bad value from a file, the environment or the command line reads the same.
It imports nothing from api/config.py (it is handed the fields), so the two form no import circle.
"""
from __future__ import annotations

import re
import typing
from typing import Any, Mapping

from annotated_types import Ge, Gt, Le, Lt
from pydantic import ValidationError
from pydantic.fields import FieldInfo

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


def check_ctx_size(value: int) -> int:
    if value != 0 and value < MIN_CTX_SIZE:
        raise ValueError(f"--ctx-size must be 0 (auto) or >= {MIN_CTX_SIZE} (got {value})")
    return value


def check_layer_split(value: str) -> str:
    try:
        cuts = [int(v) for v in value.split(",") if v.strip()] if value else []
    except ValueError:
        cuts = None
    if cuts is None or not all(c > 0 for c in cuts) or cuts != sorted(set(cuts)):
        raise ValueError(f"--layer-split {value!r} must be strictly increasing layer numbers > 0, e.g. 16,32")
    return value


def check_batch_groups(groups: str, batch: int) -> None:
    if not (groups == "auto" or (groups.isdigit() and 1 <= int(groups) <= batch)):
        raise ValueError(f"--batch-groups must be auto or 1..--batch ({batch}) (got {groups!r})")


def check_kv_cache_mib(value: str) -> str:
    if value.startswith("-"):
        raise ValueError(f"--kv-cache-mib must be >= 0 (got {value}; 0 sizes it from --batch * --ctx-size)")
    return value


def check_expert_cache_mib(value: str) -> str:
    if not (value in ("", "auto") or re.fullmatch(r"\d+(\.\d+)?", value) is not None and float(value) > 0):
        raise ValueError(f"--expert-cache-mib takes a MiB count > 0 or auto (got {value!r})")
    return value


def check_checkpoint_every(value: str) -> str:
    if not (value == "auto" or re.fullmatch(r"\d+", value) is not None):
        raise ValueError(f"--state-checkpoint-every must be auto or a whole number of KV blocks >= 0 (got "
                         f"{value!r}; 0 keeps only message starts, prompt and reply ends)")
    return value


def choices_of(field: FieldInfo) -> tuple[str, ...]:
    """A field's choices: the values of its Literal annotation; () for a field without."""
    annotation = field.annotation
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()


def explain(exc: ValidationError, fields: Mapping[str, FieldInfo]) -> str:
    """The first error of ``exc`` as a sentence naming the flag ("--batch must be >= 1 (got 0)")."""
    error = exc.errors()[0]
    if not error["loc"]:  # a check across fields: its own sentence
        return error["msg"].removeprefix("Value error, ")
    name, value, kind = str(error["loc"][0]), error.get("input"), error["type"]
    if name not in fields:
        return f"unknown setting {name!r}; valid ones are: {', '.join(fields)}"
    field, flag = fields[name], flag_name(name)
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    hint = f"; {extra['hint']}" if extra.get("hint") else ""
    if kind == "value_error":
        return error["msg"].removeprefix("Value error, ")
    if extra.get("message"):
        return str(extra["message"]).format(value=value)
    if kind == "literal_error":
        return f"{flag} {value!r} is not one of: {', '.join(choices_of(field))}"
    if kind == "string_too_short":
        unset = "; leave it unset instead" if field.default is None else ""
        return f"{flag} must not be empty{unset}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than", "finite_number"):
        return f"{flag} must be {_bounds(field)} (got {value}{hint})"
    return f"{flag}: {error['msg']} (got {value!r})"


def _bounds(field: FieldInfo) -> str:
    """">= 1", "a number > 0", "in 0..2": the field's declared limits in words."""
    low = high = None
    for limit in field.metadata:
        if isinstance(limit, (Ge, Gt)):
            low = ">=" if isinstance(limit, Ge) else ">", getattr(limit, "ge", getattr(limit, "gt", None))
        elif isinstance(limit, (Le, Lt)):
            high = getattr(limit, "le", None) if isinstance(limit, Le) else limit.lt - 1
    number = "a number " if _base_type(field) is float else ""
    if low is not None and high is not None:
        return f"in {_text(low[1])}..{_text(high)}"
    return f"{number}{low[0]} {_text(low[1])}" if low is not None else f"{number}<= {_text(high)}"


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _base_type(field: FieldInfo) -> type:
    args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
    return args[0] if args and typing.get_origin(field.annotation) is not typing.Literal else field.annotation
