"""The kernel signatures of docs/CUDA_KERNELS.md, as data: what `KernelSet.launch` packs, in this order.

Arguments are passed by name (`in` spelled `in_`), packed here in the contract's order with the contract's
C types, so a launch cannot silently swap two ints. tests/test_cuda_abi.py parses the tables of
docs/CUDA_KERNELS.md and checks every entry below against them, on machines without a GPU.
"""
from __future__ import annotations

import ctypes
import re

from engine.quant_types import CUDA_TYPES

# Copied from docs/CUDA_KERNELS.md (keep them identical; the test above compares).
_ATTENTION = ("float* out, const float* q, const float* pool_k, const float* pool_v, const int* token_seq, "
              "const int* token_pos, const int* block_tables, int max_blocks, int T, int H, int KVH, int hd, "
              "int block_size, int num_slots, int seg_rows, float scale, int window")
# --kv-type f16 / int8: the same argument lists over half / int8 pool rows (docs/CUDA_KERNELS.md).
_ATTENTION_F16 = _ATTENTION.replace("const float* pool_k, const float* pool_v",
                                    "const unsigned short* pool_k, const unsigned short* pool_v")
_ATTENTION_INT8 = _ATTENTION.replace("const float* pool_k, const float* pool_v",
                                     "const signed char* pool_k, const signed char* pool_v")
_SPLIT = ", float* part_out, float* part_max, float* part_sum, int chunk_keys"
_STORE_KV = ("float* pool_layer_k, float* pool_layer_v, const float* k, const float* v, "
             "const long long* slots, int T, int KVH, int hd, int num_slots, int seg_rows")
_KV_BLOCKS = ("float* staging, float* pool, const int* blocks, int n, int planes, int num_slots, int block_elems, "
               "int hd")
_ROPE = "float* x, const int* positions, const float* cos, const float* sin, int T, int H, int hd, int rope_dims"
_GATED = "float* out, const float* gate_up, int T, int F"
SIGNATURES: dict[str, str] = {
    "embedding_f32": "float* out, const float* table, const int* ids, int T, int d, float scale",
    "rms_norm_f32": "float* out, const float* x, const float* w, int rows, int n, float eps",
    "add_rms_norm_f32": ("float* sum_out, float* norm_out, const float* x, const float* delta, const float* w, "
                         "int rows, int n, float eps"),
    "add_f32": "float* out, const float* a, const float* b, int n",
    "mul_f32": "float* out, const float* a, const float* b, int n",
    "split_columns_f32": "float* out, const float* x, int T, int in_cols, int col_start, int out_cols",
    "rope_neox_f32": _ROPE,
    "rope_norm_f32": _ROPE,
    "store_kv_f32": _STORE_KV,
    "store_kv_f16": _STORE_KV.replace("float* pool_layer_k, float* pool_layer_v",
                                      "unsigned short* pool_layer_k, unsigned short* pool_layer_v"),
    "store_kv_int8": _STORE_KV.replace("float* pool_layer_k, float* pool_layer_v",
                                       "signed char* pool_layer_k, signed char* pool_layer_v"),
    "paged_attention_f32": _ATTENTION,
    "paged_attention_split_f32": _ATTENTION + _SPLIT,
    "paged_attention_f16": _ATTENTION_F16,
    "paged_attention_split_f16": _ATTENTION_F16 + _SPLIT,
    "paged_attention_int8": _ATTENTION_INT8,
    "paged_attention_split_int8": _ATTENTION_INT8 + _SPLIT,
    "attention_combine_f32": ("float* out, const float* part_out, const float* part_max, const float* part_sum, "
                              "int T, int H, int hd, int n_chunks"),
    "attention_combine_sinks_f32": ("float* out, const float* part_out, const float* part_max, const float* part_sum, "
                                    "const float* sinks, int T, int H, int hd, int n_chunks"),
    "gated_silu_f32": _GATED,
    "gated_gelu_tanh_f32": _GATED,
    "gather_rows_f32": "float* out, const float* x, const long long* rows, int n_rows, int d",
    "short_conv_f32": ("float* out, float* states, const float* u, const float* w, const int* seq_start, "
                       "const int* seq_len, const int* start_pos, const int* state_slot, int n_seqs, int d, int L"),
    "copy_kv_blocks_f32": ("float* pool, const int* src_blocks, const int* dst_blocks, int n_pairs, int planes, "
                           "int num_slots, int block_elems, int hd"),
    "gather_kv_blocks_f32": _KV_BLOCKS,
    "scatter_kv_blocks_f32": _KV_BLOCKS,
    "moe_route_f32": "int* ids, float* weights, const float* logits, int T, int E, int k, int gating, int normalize",
    "moe_plan": ("int* pair_rows, int* pair_of, int* group_expert, int* group_start, int* group_len, const int* ids, "
                 "int n_pairs, int k, int E, int max_groups, int group_rows"),
    "gated_swiglu_oai_f32": _GATED,
    "moe_combine_f32": "float* out, const float* y, const int* pair_of, const float* weights, int T, int k, int d",
    "sample_f32": ("int* out_ids, const float* logits, int rows, int vocab, const float* temperature, "
                   "const int* top_k, const float* top_p, const float* min_p, const unsigned long long* seeds, "
                   "const int* counters, const int* allowed_mask, int mask_words, const int* mask_rows"),
}
# moe_matvec_<q> / moe_gemm_<q> (moe.cu): one signature for every type and both, as in the doc's table.
MOE_MATVEC_SIGNATURE = ("float* y, const unsigned char* W, const unsigned long long* expert_ptr, const float* x, "
                        "const float* bias, const int* group_expert, "
                        "const int* group_start, const int* group_len, const int* pair_rows, int n_groups, int out, "
                        "int in, int ld_y")
# matvec_<q> / gemm_<q>: the table's signature plus `int ld_y` after `in` (the paragraph under that table).
QUANT_SIGNATURE = ("float* y, const unsigned char* W, const float* x, const float* bias, int T, int out, int in, "
                   "int ld_y")
QUANT_SUFFIXES = tuple(t.suffix for t in CUDA_TYPES)  # the types with kernels (engine/quant_types.py)


def signature(kernel: str) -> str:
    if kernel in SIGNATURES:
        return SIGNATURES[kernel]
    if kernel.startswith(("moe_matvec_", "moe_gemm_")):
        return MOE_MATVEC_SIGNATURE
    prefix, _, suffix = kernel.partition("_")
    if prefix in ("matvec", "gemm") and suffix:
        return QUANT_SIGNATURE
    raise KeyError(f"kernel {kernel!r} is not in docs/CUDA_KERNELS.md")


def parse_signature(text: str) -> list[tuple[str, str]]:
    """'float* out, int T' -> [('out', 'ptr'), ('T', 'int')]; kinds: ptr, int, float."""
    params = []
    for raw in text.split(","):
        match = re.fullmatch(r"\s*(?:const\s+)?([A-Za-z_ ]+?)\s*(\*?)\s*([A-Za-z_]\w*)\s*", raw)
        assert match, f"cannot parse parameter {raw!r}"
        ctype, star, name = match.groups()
        kind = "ptr" if star else {"int": "int", "float": "float"}[ctype.strip()]
        params.append((name, kind))
    return params


_PARSED: dict[str, list[tuple[str, str]]] = {}


def params(kernel: str) -> list[tuple[str, str]]:
    if kernel not in _PARSED:
        _PARSED[kernel] = parse_signature(signature(kernel))
    return _PARSED[kernel]


def arg_name(param: str) -> str:
    """The keyword a launch uses for a parameter: C's `in` is a Python keyword, so it is `in_`."""
    return "in_" if param == "in" else param


def pack(kernel: str, args: dict) -> tuple[list, dict[str, int]]:
    """(ctypes values in contract order, the int arguments by keyword for geometry()).

    Pointers may be ints, None (a null pointer) or objects with an int `.ptr` (DeviceArray).
    """
    names = [arg_name(p) for p, _ in params(kernel)]
    missing, extra = set(names) - set(args), set(args) - set(names)
    assert not missing and not extra, f"{kernel}: missing {sorted(missing)}, unexpected {sorted(extra)}"
    values, ints = [], {}
    for (param, kind), name in zip(params(kernel), names):
        value = args[name]
        if kind == "ptr":
            values.append(ctypes.c_void_p(_address(value)))
        elif kind == "int":
            assert -2**31 <= int(value) < 2**31, f"{kernel}: {name}={value} does not fit an int"
            values.append(ctypes.c_int(int(value)))
            ints[name] = int(value)
        else:
            values.append(ctypes.c_float(float(value)))
    return values, ints


def _address(value) -> int | None:
    if value is None:
        return None
    return int(getattr(value, "ptr", value))
