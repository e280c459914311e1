"""Rows decoded from the repacked forms (engine/backends/cpu/repacked_rows.py) against gguf's dequantisation,
and a QuantLinear that adopted them (its raw rows let go) computing as before."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.backends.cpu.int8_repack import HALF_SCALE_TYPES, INT8_TYPES, repack
from engine.backends.cpu.quant_linear import QuantLinear
from engine.backends.cpu.repacked_rows import dequant_part, gather_part
from engine.quant_weights import LinearPart
from tests.support.quant_rows import assert_close_both_ways, random_rows, reference


@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
@pytest.mark.parametrize("tensor_type", INT8_TYPES, ids=lambda t: t.name)
def test_decoded_rows_are_ggufs_dequantisation(tensor_type, half):
    if half and tensor_type not in HALF_SCALE_TYPES:
        pytest.skip("k-quant scales stay float32")
    rows = random_rows(tensor_type, 11, 512)
    part = tuple(repack(tensor_type, rows, 512, half_scales=half))
    out = np.empty((11, 512), np.float32)
    dequant_part(part, 0, out)
    np.testing.assert_array_equal(out, reference(tensor_type, rows, 11, 512))
    picked = np.empty((3, 512), np.float32)
    gather_part(part, np.array([7, 0, 7], np.int64), picked)
    np.testing.assert_array_equal(picked, out[[7, 0, 7]])


def test_an_adopting_linear_computes_as_its_raw_rows_did():
    """Few rows: the same float products; a prefill's many rows: on integers (cpu/int8_gemm.py), within the
    int16 activation rounding of the float product."""
    a, b = random_rows(Q.Q4_1, 40, 256), random_rows(Q.Q6_K, 24, 256)
    linear = QuantLinear([LinearPart(Q.Q4_1, a, 40, 256, "a"), LinearPart(Q.Q6_K, b, 24, 256, "b")])
    x_few = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    x_many = np.random.default_rng(1).standard_normal((20, 256)).astype(np.float32)
    before = [linear.matmul(x_few), linear.matmul(x_many), linear.dequantize()]
    assert linear.adopt_repacked([repack(Q.Q4_1, a, 256), repack(Q.Q6_K, b, 256)]) == []  # copies, no mapping
    assert all(rows.size == 0 for _, rows, _ in linear.parts)  # the raw rows are let go
    after = [linear.matmul(x_few), linear.matmul(x_many), linear.dequantize()]
    np.testing.assert_array_equal(after[2], before[2])
    np.testing.assert_allclose(after[0], before[0], rtol=1e-5, atol=1e-4)
    assert_close_both_ways(after[1], x_many, before[2], np.float32(32767.0))  # int16, adopt_repacked's default


def test_the_head_takes_float16_scales_when_only_the_layers_cannot():
    """gemma3's shape: k-quant layers (float32 scales) beside a Q8_0 head, whose scales are float16 exactly."""
    from engine.backends.cpu.fused_decoder import _repack_and_adopt

    layer = QuantLinear([LinearPart(Q.Q6_K, random_rows(Q.Q6_K, 8, 256), 8, 256, "l")])
    head_rows = random_rows(Q.Q8_0, 16, 256)
    head = QuantLinear([LinearPart(Q.Q8_0, head_rows, 16, 256, "h")])
    want = reference(Q.Q8_0, head_rows, 16, 256)
    pairs, _ = _repack_and_adopt([layer], head)
    assert pairs[0][0][3].dtype == np.float32 and pairs[1][0][3].dtype == np.uint16
    np.testing.assert_array_equal(head.dequantize(), want)
