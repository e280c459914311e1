"""The quantised matvec/gemm kernels run on the CPU (tests/support/kernel_emulator.py, inline PTX through
tests/support/cuda_emulation/ptx_emulation.h): every type against gguf's dequantisation, writing only its column range
of y. The gemm is checked tightly against a product of fp16-rounded operands (what the MMA consumes), so an
error in the mma fragment layout or the fp16 packing cannot hide inside the fp16 tolerance."""
import numpy as np
import pytest

from cuda_kernels.quant_types import QUANT_TYPES
from tests.support.cuda_helpers import random_weight


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    from tests.support.kernel_emulator import EmulatedSource, compiler_available

    if not compiler_available():
        pytest.skip("g++ is needed to run the CUDA kernels on the CPU")
    build_dir = tmp_path_factory.mktemp("emulated_quant")
    return {kind: EmulatedSource(f"{kind}_quant.cu", build_dir) for kind in ("matvec", "gemm")}


def _fp16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


@pytest.mark.parametrize("kind, T", [("matvec", 3), ("gemm", 70)])
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_emulated_kernel_matches_gguf_dequantised_product(emulated, type_name, kind, T):
    rng = np.random.default_rng(1)
    out, in_dim, col = 70, 256, 5  # 70 rows: a partial CTA tile in both kernels; 70 tokens: two gemm row tiles
    ld_y = out + 11
    raw, dense = random_weight(type_name, out, in_dim, rng)
    x = rng.standard_normal((T, in_dim)).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    y = np.full((T, ld_y), np.nan, dtype=np.float32)
    # y + col with row stride ld_y, as the backend launches a part of a fused matrix
    y_part = np.frombuffer(y, dtype=np.float32, offset=4 * col, count=y.size - col)
    emulated[kind].launch(f"{kind}_{QUANT_TYPES[type_name].suffix}", y=y_part, W=raw.reshape(-1),
                          x=x.reshape(-1), bias=bias, T=T, out=out, in_=in_dim, ld_y=ld_y)
    got = y[:, col:col + out]
    assert np.isnan(y[:, :col]).all() and np.isnan(y[:, col + out:]).all(), "wrote outside its columns"
    if kind == "matvec":
        np.testing.assert_allclose(got, x.astype(np.float64) @ dense.T + bias, rtol=1e-4, atol=1e-4)
    else:
        np.testing.assert_allclose(got, _fp16(x) @ _fp16(dense).T + bias, rtol=1e-5, atol=1e-4)
