"""Quantised matvec/gemm kernels (cuda_kernels/matvec_quant.cu, gemm_quant.cu): the sources compile for every
supported arch and define every kernel, the type table agrees with gguf, and on a GPU every kernel matches
gguf's own dequantisation followed by a float64 product."""
import itertools
import os
import re

import gguf
import numpy as np
import pytest

from cuda_kernels import gemm_quant, matvec_quant
from cuda_kernels.registry import expand_includes, read_source
from cuda_kernels.build import DEFAULT_ARCHS
from cuda_kernels.quant_types import (MATVEC_MAX_T, QUANT_TYPES, check_in_dim, kernel_name, row_bytes,
                                      supported, use_gemm)
from tests.support.cuda_helpers import KERNEL_DIR, Device, nvrtc_compile, random_weight

SOURCES = {"matvec_quant.cu": "matvec", "gemm_quant.cu": "gemm"}
ARCHS = DEFAULT_ARCHS


def _expected_names(source: str) -> set[str]:
    return {f"{SOURCES[source]}_{qt.suffix}" for qt in QUANT_TYPES.values()}


def _require_nvrtc():
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("cuda-python is required in CI: pip install -e '.[cuda]'")
        pytest.skip("cuda-python not installed (pip install -e '.[cuda]')")


@pytest.mark.parametrize("source", SOURCES)
def test_source_declares_every_kernel_as_the_registry_parses_it(source):
    text = read_source(source)
    declared = set(re.findall(r'extern "C" __global__ void (\w+)\(', text))
    assert declared == _expected_names(source)
    assert "#include" not in text  # NVRTC gets no include path: the registry expanded gguf_blocks.cuh


def test_both_sources_take_the_block_decoders_from_one_header():
    header = (KERNEL_DIR / "gguf_blocks.cuh").read_text()
    for source in SOURCES:
        assert '#include "gguf_blocks.cuh"' in (KERNEL_DIR / source).read_text()
        assert header in read_source(source)


def test_include_expansion_names_a_missing_header_and_a_cycle(tmp_path):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\n')
    (tmp_path / "b.cuh").write_text('#include "a.cuh"\n')
    with pytest.raises(ValueError, match="cycle"):
        expand_includes('#include "a.cuh"\n', tmp_path)
    with pytest.raises(ValueError, match="missing.cuh"):
        expand_includes('#include "missing.cuh"\n', tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_without_warnings_or_spills(source, arch):
    _require_nvrtc()
    cubin, log = nvrtc_compile(source, arch)
    compiled = set(re.findall(r"Compiling entry function '(\w+)'", log))
    assert compiled == _expected_names(source), log
    for name in compiled:
        assert b"\x00" + name.encode() + b"\x00" in cubin, f"{name} missing from the CUBIN symbols"
    assert "warning" not in log.lower(), log
    assert all(m == "0" for m in re.findall(r"(\d+) bytes spill", log)), log


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_quant_type_block_geometry_matches_gguf(name):
    qt = QUANT_TYPES[name]
    assert (qt.block_elems, qt.block_bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert supported(name) and supported(gguf.GGMLQuantizationType[name])


def test_row_bytes_is_whole_blocks_and_rejects_partial_rows():
    assert row_bytes("Q4_K", 512) == 2 * 144
    assert row_bytes(gguf.GGMLQuantizationType.F32, 40) == 160
    for qtype, bad_in in (("Q4_K", 288), ("Q8_0", 48), ("F16", 12)):
        with pytest.raises(ValueError):
            check_in_dim(qtype, bad_in)
    assert not supported("Q5_K") and not supported("IQ2_XS")


def test_matvec_serves_decode_and_gemm_everything_larger():
    assert [use_gemm(T) for T in (1, MATVEC_MAX_T, MATVEC_MAX_T + 1)] == [False, False, True]
    assert kernel_name("Q6_K", 1) == "matvec_q6_k" and kernel_name("Q6_K", 512) == "gemm_q6_k"


def test_geometry_covers_every_row_and_token():
    grid, block, shared = matvec_quant.geometry("matvec_q4_1", T=8, out=257, in_=512, ld_y=300)
    assert grid[0] * matvec_quant.MATVEC_ROWS_PER_CTA >= 257 > (grid[0] - 1) * matvec_quant.MATVEC_ROWS_PER_CTA
    assert block == (128, 1, 1) and shared == 0
    grid, block, shared = gemm_quant.geometry("gemm_q4_1", T=130, out=257, in_=512, ld_y=257)
    assert grid[0] * gemm_quant.GEMM_BM >= 257 and grid[1] * gemm_quant.GEMM_BN >= 130
    with pytest.raises(ValueError):
        matvec_quant.geometry("matvec_q4_1", T=MATVEC_MAX_T + 1, out=64, in_=256, ld_y=64)


# ---- on a GPU ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.cuda)])
def device():
    """Device 0 with both sources compiled for its arch; the "gpu" param carries the `cuda` mark, so every
    test using it is selected by `pytest -m cuda` (tests/conftest.py)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        pytest.skip("cuda-python not installed")
    try:  # without a driver library cuInit raises instead of returning an error status
        has_device = int(driver.cuInit(0)[0]) == 0 and driver.cuDeviceGetCount()[1] > 0
    except Exception as exc:  # noqa: BLE001 - any failure to reach a driver means "no device here"
        pytest.skip(f"no CUDA driver: {exc}")
    if not has_device:
        pytest.skip("no CUDA device")
    dev = Device()
    dev.cubins = {source: nvrtc_compile(source, dev.arch)[0] for source in SOURCES}
    yield dev
    dev.close()


def _run(device, kind, type_name, raw, x, bias, out, col, ld_y):
    """y [T, ld_y] poisoned with NaN, the kernel writing columns [col, col + out)."""
    T, in_dim = x.shape
    name = f"{kind}_{QUANT_TYPES[type_name].suffix}"
    geometry = (matvec_quant if kind == "matvec" else gemm_quant).geometry
    grid, block, shared = geometry(name, T=T, out=out, in_=in_dim, ld_y=ld_y)
    y = np.full((T, ld_y), np.nan, dtype=np.float32)
    y_ptr = device.upload(y)
    args = [("ptr", y_ptr + 4 * col), ("ptr", device.upload(raw)), ("ptr", device.upload(x)),
            ("ptr", device.upload(bias) if bias is not None else 0),
            ("int", T), ("int", out), ("int", in_dim), ("int", ld_y)]
    device.launch(device.function(device.cubins[f"{kind}_quant.cu"], name), grid, block, shared, args)
    return device.download(y_ptr, y)


@pytest.mark.parametrize("kind, token_counts, tolerance",
                         [("matvec", (1, 3, 8), 1e-4), ("gemm", (17, 64, 130), 1e-2)], ids=["matvec", "gemm"])
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_kernel_matches_gguf_dequantised_product(device, type_name, kind, token_counts, tolerance):
    rng = np.random.default_rng(0)
    for T, out, in_dim in itertools.product(token_counts, (64, 257), (256, 512, 2048)):
        raw, dense = random_weight(type_name, out, in_dim, rng)
        x = rng.standard_normal((T, in_dim)).astype(np.float32)
        bias = rng.standard_normal(out).astype(np.float32) if out == 257 else None  # 64: null bias
        col, ld_y = 5, out + 11
        y = _run(device, kind, type_name, raw, x, bias, out, col, ld_y)
        expected = x.astype(np.float64) @ dense.T + (0.0 if bias is None else bias)
        got = y[:, col:col + out]
        shape = f"T={T} out={out} in={in_dim}"
        assert np.isfinite(got).all(), f"{kind}_{type_name} {shape}: unwritten or non-finite outputs"
        assert np.isnan(y[:, :col]).all() and np.isnan(y[:, col + out:]).all(), f"{shape}: wrote outside its columns"
        rel_err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert rel_err < tolerance, f"{kind}_{type_name} {shape}: relative error {rel_err:.2e}"
