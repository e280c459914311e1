"""The backend's copy of the kernel signatures matches docs/CUDA_KERNELS.md, and launches pack by name."""
import ctypes
import re
from pathlib import Path

import pytest

from engine.backends.cuda import abi as cuda_abi

DOC = (Path(__file__).resolve().parent.parent / "docs" / "CUDA_KERNELS.md").read_text()


def _doc_rows() -> dict[str, str]:
    """kernel name -> signature text, from the doc's tables ("same" / "as above + ..." resolved)."""
    rows, previous = {}, None
    for names, signature in re.findall(r"^\| (`[^|]+`) \| (.+?) \| .+ \|$", DOC, re.M):
        text = signature.strip().strip("`")
        if text == "same":
            text = previous
        elif text.startswith("as above + "):
            text = previous + ", " + re.search(r"\((.*)\)", text).group(1)
        else:
            text = text.strip("()")
        for name in re.findall(r"`([^`]+)`", names):
            rows[name] = text
        previous = text
    return rows


def test_every_kernel_signature_matches_the_doc():
    rows = _doc_rows()
    for kernel, signature in cuda_abi.SIGNATURES.items():
        assert cuda_abi.parse_signature(signature) == cuda_abi.parse_signature(rows[kernel]), kernel
    assert set(rows) - set(cuda_abi.SIGNATURES) == {"matvec_<q>", "gemm_<q>", "moe_matvec_<q>",
                                                       "moe_gemm_<q>"}
    assert cuda_abi.params("moe_matvec_q4_k") == cuda_abi.parse_signature(rows["moe_matvec_<q>"])
    assert cuda_abi.params("moe_gemm_mxfp4") == cuda_abi.parse_signature(rows["moe_gemm_<q>"])


def test_quant_signature_is_the_doc_table_plus_ld_y_after_in():
    table = cuda_abi.parse_signature(_doc_rows()["matvec_<q>"])
    assert cuda_abi.params("gemm_q4_k") == table + [("ld_y", "int")]
    assert "`<q>` in `" + ", ".join(cuda_abi.QUANT_SUFFIXES) + "`" in DOC


def test_pack_orders_arguments_as_the_contract_whatever_the_keyword_order():
    args = dict(out_cols=3, col_start=2, in_cols=9, T=4, x=0x200, out=0x100)
    values, ints = cuda_abi.pack("split_columns_f32", args)
    assert [v.value for v in values] == [0x100, 0x200, 4, 9, 2, 3]
    assert [type(v) for v in values] == [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    assert ints == {"T": 4, "in_cols": 9, "col_start": 2, "out_cols": 3}


def test_pack_spells_in_as_in_and_passes_floats_and_null_pointers():
    values, ints = cuda_abi.pack("matvec_q8_0", dict(y=1, W=2, x=3, bias=None, T=1, out=5, in_=64, ld_y=5))
    assert values[3].value is None and ints == {"T": 1, "out": 5, "in_": 64, "ld_y": 5}
    values, _ = cuda_abi.pack("rms_norm_f32", dict(out=1, x=2, w=3, rows=1, n=8, eps=1e-6))
    assert isinstance(values[-1], ctypes.c_float)


def test_pack_rejects_missing_and_unknown_arguments():
    with pytest.raises(AssertionError, match="missing"):
        cuda_abi.pack("add_f32", dict(out=1, a=2, n=3))
    with pytest.raises(AssertionError, match="unexpected"):
        cuda_abi.pack("add_f32", dict(out=1, a=2, b=3, n=3, stream=0))
