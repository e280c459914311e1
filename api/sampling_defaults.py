"""Sampling settings for requests that set none: the model's recommended ones, resolved once at start.

Agent clients (Codex CLI, Claude Code) send no temperature; at OpenAI's 1.0 a 0.5B coder model wanders off
the tool call it was asked for. So every field a request leaves out takes, first found wins:

    the operator's --default-temperature (temperature only)
    > the GGUF's general.sampling.* keys (llama.cpp's gguf writer defines them; llama-server reads them too)
    > the model store entry's ``sampling`` (engine/model_store.py: the publisher's generation_config)
    > llama-server's own defaults (llama.cpp common/common.h, common_params_sampling)

and a field the request sets wins over all of them. Fields resolve one by one, as llama.cpp applies the GGUF
keys it finds: a file that names only its temperature keeps llama-server's top_k. The GGUF's sampler
``sequence`` is not followed (sampling order is engine/sampling.py's), and mirostat / XTC are not
implemented: a file that asks for them is logged once at start.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from gguf.constants import Keys

from api.errors import bad_request
from engine.gguf_file import GGUFFile
from engine.model_store import KNOWN_MODELS, ModelSource
from engine.sampling import SamplingParams

log = logging.getLogger("strata.serve")
LLAMA_SERVER = "llama-server's defaults"
OPERATOR = "--default-temperature"
_GGUF = "the GGUF's general.sampling keys"
# Our field -> the GGUF key llama.cpp's writer uses for it.
_GGUF_KEYS = {"temperature": Keys.General.SAMPLING_TEMP, "top_k": Keys.General.SAMPLING_TOP_K,
              "top_p": Keys.General.SAMPLING_TOP_P, "min_p": Keys.General.SAMPLING_MIN_P,
              "repetition_penalty": Keys.General.SAMPLING_PENALTY_REPEAT,
              "repetition_last_n": Keys.General.SAMPLING_PENALTY_LAST_N}
# The store entry's names (llama.cpp's CLI spelling, repeat_penalty) -> our field.
_STORE_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                "repeat_penalty": "repetition_penalty"}
_UNSUPPORTED_KEYS = (Keys.General.SAMPLING_MIROSTAT, Keys.General.SAMPLING_XTC_PROBABILITY)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets, and where each value came from.

    The field defaults are llama-server's (common_params_sampling: temp 0.80, top_k 40, top_p 0.95,
    min_p 0.05, penalty_repeat 1.00 over penalty_last_n 64)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    repetition_last_n: int = 64
    sources: tuple[tuple[str, str], ...] = ()  # (field, where it came from) for those not llama-server's

    def params(self, *, max_tokens: int, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
               **rest: Any) -> SamplingParams:
        """SamplingParams for one request: each of its fields given as None takes this default; ``rest``
        (seed, stop, penalties, ...) passes through. Raises ValueError naming a field out of range."""
        def pick(value, default):
            return default if value is None else value
        return SamplingParams(temperature=pick(temperature, self.temperature), top_k=pick(top_k, self.top_k),
                              top_p=pick(top_p, self.top_p), min_p=pick(min_p, self.min_p),
                              repetition_penalty=pick(repetition_penalty, self.repetition_penalty),
                              repetition_last_n=self.repetition_last_n, max_tokens=max_tokens, **rest)

    def source_of(self, name: str) -> str:
        """Where field ``name``'s value came from: the GGUF, the store entry, the flag, or llama-server."""
        return dict(self.sources).get(name, LLAMA_SERVER)

    def describe(self) -> str:
        """The values grouped by where they came from, as the start-up line shows them."""
        groups: dict[str, list[str]] = {}
        for f in fields(self):
            if f.name in ("sources", "repetition_last_n"):
                continue
            value = getattr(self, f.name)
            text = f"{f.name} {value:g}" if isinstance(value, float) else f"{f.name} {value}"
            if f.name == "repetition_penalty" and value != 1.0:
                text += f" over the last {self.repetition_last_n} generated tokens"
            groups.setdefault(self.source_of(f.name), []).append(text)
        return "; ".join(f"{' '.join(texts)} (from {where})" for where, texts in groups.items())


def resolve_params(requested: Mapping[str, Any], defaults: SamplingDefaults, default_seed: int | None,
                   max_tokens: int) -> SamplingParams:
    """SamplingParams from ``requested`` (SamplingParams' field names, None where left out): a field left out
    takes the model's ``defaults``, the seed ``default_seed``. Raises ValueError naming a field out of range.
    The server's dialects (through sampling_for) and `strata generate` both build their sampling here."""
    given = {name: value for name, value in requested.items() if value is not None}
    seed = given.pop("seed", default_seed)
    return defaults.params(max_tokens=max_tokens, seed=seed, **given)


def sampling_for(requested: Mapping[str, Any], defaults: SamplingDefaults,
                 default_seed: int | None) -> Callable[[int], SamplingParams]:
    """How every dialect builds a request's sampling: max_tokens (known once the context's room is) ->
    SamplingParams. ``requested`` holds the body's sampling fields under SamplingParams' names, None where
    the body left one out: those take the model's ``defaults``, the seed ``--seed`` (``default_seed``).
    A value SamplingParams refuses is a 400 naming the field."""
    def make(max_tokens: int) -> SamplingParams:
        try:
            return resolve_params(requested, defaults, default_seed, max_tokens)
        except ValueError as exc:  # SamplingParams messages start with the field's name
            raise bad_request(str(exc), param=str(exc).split()[0]) from exc
    return make


_KINDS = SamplingDefaults()  # each field's type, int or float, read from its default


def resolve_sampling_defaults(gguf_fields: Mapping[str, Any], store_entry: ModelSource | None,
                              default_temperature: float | None = None) -> SamplingDefaults:
    """The defaults from a model's GGUF metadata, its store entry (None for a file the store does not know)
    and the operator's --default-temperature, each field from the first source that has it. A value
    SamplingParams refuses (a GGUF's top_p 0) is logged and the next source's taken, so it cannot fail every
    request."""
    candidates: list[tuple[str, Any, str]] = []  # (field, value, source), lowest precedence first
    if store_entry is not None:
        where = f"the model store entry {store_entry.name}"
        candidates += [(_STORE_NAMES[k], v, where) for k, v in store_entry.sampling]
    candidates += [(name, gguf_fields[key], _GGUF) for name, key in _GGUF_KEYS.items() if key in gguf_fields]
    if default_temperature is not None:
        candidates.append(("temperature", default_temperature, OPERATOR))
    found: dict[str, tuple[Any, str]] = {}
    for name, raw, where in candidates:
        value = _checked(name, raw, where)
        if value is not None:
            found[name] = (value, where)
    return SamplingDefaults(**{name: value for name, (value, _) in found.items()},
                            sources=tuple((name, where) for name, (_, where) in found.items()))


def _checked(name: str, raw: Any, where: str) -> int | float | None:
    """``raw`` as field ``name``'s type, or None (logged) when SamplingParams would refuse it."""
    try:
        if isinstance(getattr(_KINDS, name), int):
            value = int(raw)
        else:  # GGUF floats are float32 (0.1 reads 0.10000000149): 7 digits give back the value written
            value = float(f"{float(raw):.7g}")
        SamplingParams(**{name: value})
    except (TypeError, ValueError) as exc:
        log.warning("ignoring %s %r from %s: %s", name, raw, where, exc)
        return None
    return value


def store_entry_for(path: str | Path) -> ModelSource | None:
    """The model store entry whose file this is (matched by file name), None for any other file."""
    name = Path(path).name
    return next((source for source in KNOWN_MODELS.values() if source.file_name == name), None)


def load_sampling_defaults(path: str | Path, default_temperature: float | None = None) -> SamplingDefaults:
    """The defaults for the model file at ``path`` (its header is read again: LoadedModel keeps no metadata);
    logs them once, with where they came from, and any GGUF sampling key this server does not follow."""
    gguf_fields = GGUFFile(path).fields
    defaults = resolve_sampling_defaults(gguf_fields, store_entry_for(path), default_temperature)
    log.info("sampling defaults for requests that set none: %s", defaults.describe(),
             extra={"fields": {"sampling_defaults": {f.name: getattr(defaults, f.name) for f in fields(defaults)
                                                     if f.name != "sources"}}})
    ignored = [key for key in _UNSUPPORTED_KEYS if gguf_fields.get(key)]
    if ignored:
        log.warning("the model file asks for %s, which this server does not implement; sampling without them",
                    ", ".join(ignored))
    return defaults
