"""Every CUDA kernel source compiles with NVRTC for the archs we ship, and the build cache behaves.

No GPU needed: NVRTC compiles to CUBIN on the CPU. Without cuda-python these tests skip, except under CI
(`CI` set), where NVRTC is part of the environment (scripts/setup.sh installs `.[test,cuda]`) and its
absence is a failure.
"""
from __future__ import annotations

import os
import sys

import pytest

from api.cli import main
from cuda_kernels import build, check, registry

ARCHS = build.DEFAULT_ARCHS
ELEMENTWISE_SOURCES = ("elementwise.cu", "norms.cu", "rope.cu", "kv_blocks.cu")


def _require_nvrtc() -> None:
    try:
        build.load_nvrtc()
    except build.NvrtcUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"NVRTC is required under CI: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def kernel_home(tmp_path_factory):
    """One STRATA_HOME for the session, so sources compiled once are cache hits for later tests."""
    home = tmp_path_factory.mktemp("strata_home")
    previous = os.environ.get("STRATA_HOME")
    os.environ["STRATA_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("STRATA_HOME", None)
    else:
        os.environ["STRATA_HOME"] = previous


@pytest.fixture(scope="session")
def compiled_matrix(kernel_home):
    """Every source for every arch: {(source, arch): CompiledSource}."""
    _require_nvrtc()
    compiled, failures = check.compile_matrix(ARCHS)
    assert not failures, "\n".join(str(f) for f in failures)
    return {(c.name, c.arch): c for c in compiled}


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    _require_nvrtc()
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    return tmp_path


def test_every_source_compiles_for_every_arch(compiled_matrix):
    assert set(compiled_matrix) == {(name, arch) for name in registry.SOURCES for arch in ARCHS}
    for compiled in compiled_matrix.values():
        assert compiled.cubin.startswith(b"\x7fELF"), f"{compiled.name} {compiled.arch} is not a cubin"


def test_every_declared_kernel_is_in_the_resource_table(compiled_matrix):
    for (name, arch), compiled in compiled_matrix.items():
        missing = set(registry.SOURCES[name]) - set(compiled.kernels)
        assert not missing, f"{name} for {arch}: ptxas reported nothing for {sorted(missing)}"
        assert all(res.registers > 0 for res in compiled.kernels.values())


def test_elementwise_kernels_do_not_spill(compiled_matrix):
    for (name, arch), compiled in compiled_matrix.items():
        if name in ELEMENTWISE_SOURCES:
            spilling = {k: r.spill_bytes for k, r in compiled.kernels.items() if r.spill_bytes}
            assert not spilling, f"{name} spills on {arch}: {spilling}"


def test_second_compile_is_a_cache_hit(fresh_home):
    first = build.compile_source("norms.cu", "sm_90")
    second = build.compile_source("norms", "sm_90")
    assert (first.cached, second.cached) == (False, True)
    assert second.cubin == first.cubin
    assert second.compile_ms == first.compile_ms
    assert second.kernels == first.kernels


def test_cache_key_changes_with_options_and_arch():
    text = registry.read_source("norms.cu")
    base = build.cache_key(text, ("--std=c++17",), "sm_90", (12, 9))
    assert build.cache_key(text, ("--std=c++17", "-DX=1"), "sm_90", (12, 9)) != base
    assert build.cache_key(text, ("--std=c++17",), "sm_89", (12, 9)) != base
    assert build.cache_key(text, ("--std=c++17",), "sm_90", (13, 0)) != base
    assert build.cache_key(text + "\n", ("--std=c++17",), "sm_90", (12, 9)) != base


def test_new_options_or_arch_miss_the_cache(fresh_home):
    build.compile_source("norms.cu", "sm_90")
    assert not build.compile_source("norms.cu", "sm_90", extra_options=("-DSTRATA_TEST_OPTION=1",)).cached
    assert not build.compile_source("norms.cu", "sm_86").cached
    assert len(list((fresh_home / "kernels").glob("*.bin"))) == 3


@pytest.mark.parametrize("damage", ["truncate", "flip_cubin_byte", "garbage"])
def test_corrupt_cache_file_is_recompiled(fresh_home, damage):
    original = build.compile_source("norms.cu", "sm_90")
    (path,) = (fresh_home / "kernels").glob("norms-sm_90-*.bin")
    blob = path.read_bytes()
    damaged = {
        "truncate": blob[: len(blob) // 2],
        "flip_cubin_byte": blob[:-1] + bytes([blob[-1] ^ 0xFF]),
        "garbage": b"not a cache file",
    }[damage]
    path.write_bytes(damaged)
    rebuilt = build.compile_source("norms.cu", "sm_90")
    assert not rebuilt.cached and rebuilt.cubin == original.cubin
    assert build.compile_source("norms.cu", "sm_90").cached  # the rebuilt file replaced the damaged one


def test_missing_cuda_python_raises_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)  # makes `import cuda...` raise ImportError
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(build.NvrtcUnavailable, match=r"pip install -e '\.\[cuda\]'"):
        build.load_nvrtc()


def test_kernels_check_cli_prints_every_kernel(kernel_home, capsys):
    _require_nvrtc()
    assert main(["kernels", "--check", "--arch", "sm_90"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["kernel", "source", "arch"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == set(registry.KERNELS)
    for kernel, fields in rows.items():
        assert fields[1] == registry.KERNELS[kernel] and fields[2] == "sm_90"


def test_kernels_check_cli_fails_with_the_nvrtc_log(kernel_home, tmp_path, monkeypatch, capsys):
    _require_nvrtc()
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken_f32(float* out) { out[0] = missing; }\n')
    monkeypatch.setattr(registry, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(registry, "SOURCES", registry.discover_sources(tmp_path))
    assert main(["kernels", "--check", "--arch", "sm_90"]) == 1
    err = capsys.readouterr().err
    assert "broken.cu" in err and "identifier \"missing\" is undefined" in err


def test_kernels_without_check_lists_sources_and_kernels(capsys):
    assert main(["kernels"]) == 0
    listed = dict(line.split(": ") for line in capsys.readouterr().out.splitlines())
    assert {source: tuple(names.split(", ")) for source, names in listed.items()} == registry.SOURCES


def test_kernels_check_rejects_a_bad_arch_name():
    with pytest.raises(ValueError, match="--arch"):
        check.validate_arch("hopper")
