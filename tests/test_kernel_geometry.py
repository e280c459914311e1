"""Launch geometry of the CUDA kernels (no GPU, no NVRTC): every grid covers every element, and the
registry finds kernels in new source files. Also the host twin of sample_f32's Philox generator."""
from __future__ import annotations

import re

import numpy as np
import pytest

from cuda_kernels import attention, registry
from cuda_kernels.sampling import philox4x32_10, philox_uniform

# The kernels of docs/CUDA_KERNELS.md's "Kernels" table (other sources may add more).
DOC_KERNELS = (
    "embedding_f32", "rms_norm_f32", "add_rms_norm_f32", "add_f32", "mul_f32", "split_columns_f32", "rope_neox_f32",
    "rope_norm_f32", "store_kv_f32", "paged_attention_f32", "paged_attention_split_f32",
    "attention_combine_f32", "gated_silu_f32", "gated_gelu_tanh_f32", "gather_rows_f32", "copy_kv_blocks_f32",
    "gather_kv_blocks_f32", "scatter_kv_blocks_f32", "sample_f32",
)
# Odd sizes everywhere, so no grid comes out exact by luck. H is a multiple of KVH (GQA).
ODD_INTS = dict(
    T=7, d=37, n=1001, rows=13, in_cols=99, col_start=5, out_cols=33, H=9, KVH=3, hd=80, rope_dims=46,
    num_slots=45, seg_rows=0, max_blocks=5, block_size=9, window=0, chunk_keys=17, n_chunks=3, F=131, n_rows=3,
    n_pairs=3, planes=11, block_elems=9 * 80, vocab=4099, mask_words=129,
)
FLAT_ELEMENTS = {
    "embedding_f32": 7 * 37, "add_f32": 1001, "mul_f32": 1001, "split_columns_f32": 7 * 33, "gather_rows_f32": 3 * 37,
    "gated_silu_f32": 7 * 131, "gated_gelu_tanh_f32": 7 * 131, "rope_neox_f32": 7 * 9 * 23,
    "rope_norm_f32": 7 * 9 * 23, "store_kv_f32": 7 * 3 * 80,
}
_INT_PARAM = re.compile(r"\bint\s+(\w+)\s*[,)]")


def int_params(kernel: str) -> list[str]:
    """Names of a kernel's int arguments, read from its declaration in the source."""
    text = registry.read_source(registry.source_of(kernel))
    declaration = re.search(rf"\b{kernel}\s*\(([^)]*)\)", text).group(1)
    return _INT_PARAM.findall(declaration + ")")


def launch(kernel: str, **overrides):
    ints = {name: overrides.get(name, ODD_INTS[name]) for name in int_params(kernel)}
    return registry.geometry(kernel, **ints)


def test_every_documented_kernel_is_discovered_with_a_geometry():
    for kernel in DOC_KERNELS:
        grid, block, shared = launch(kernel)
        assert all(g >= 1 for g in grid) and all(b >= 1 for b in block) and shared >= 0
        assert block[0] * block[1] * block[2] <= 1024 and block[0] % 32 == 0


@pytest.mark.parametrize("kernel", sorted(FLAT_ELEMENTS))
def test_flat_grid_covers_every_element_once(kernel):
    (grid_x, _, _), (block_x, _, _), _ = launch(kernel)
    thread_ids = np.arange(grid_x * block_x)
    covered = thread_ids[thread_ids < FLAT_ELEMENTS[kernel]]  # the kernels' bounds check
    assert np.array_equal(covered, np.arange(FLAT_ELEMENTS[kernel]))
    assert (grid_x - 1) * block_x < FLAT_ELEMENTS[kernel], "a whole block with nothing to do"


def test_row_kernels_get_one_block_per_row():
    for kernel in ("rms_norm_f32", "add_rms_norm_f32"):
        (grid_x, _, _), (block_x, _, _), _ = launch(kernel, rows=13, n=1001)
        assert grid_x == 13 and block_x % 32 == 0 and block_x <= 1024
    assert launch("sample_f32", rows=3)[0] == (3, 1, 1)


def test_attention_has_one_block_per_row_and_head():
    assert launch("paged_attention_f32", T=7, H=9)[0] == (63, 1, 1)
    (grid_x, _, _), (block_x, _, _), shared = launch("attention_combine_f32", T=7, H=9, n_chunks=3)
    assert grid_x == 63 and block_x >= 80 and shared == 3 * 4


def test_split_attention_chunks_cover_the_longest_key_range():
    grid, _, _ = launch("paged_attention_split_f32", max_blocks=5, block_size=9, chunk_keys=17)
    assert grid == (63, 3, 1) and 3 * 17 >= 5 * 9 > 2 * 17
    assert attention.num_chunks(max_blocks=5, block_size=9, chunk_keys=17, window=10) == 1


def test_attention_rejects_head_dims_beyond_256_and_uneven_gqa():
    with pytest.raises(ValueError, match="head_dim"):
        launch("paged_attention_f32", hd=257)
    with pytest.raises(ValueError, match="multiple of KVH"):
        launch("paged_attention_f32", H=8, KVH=3)


def test_kv_block_moves_launch_at_least_one_block_for_any_size():
    for kernel in ("copy_kv_blocks_f32", "gather_kv_blocks_f32", "scatter_kv_blocks_f32"):
        assert launch(kernel, n_pairs=1, n=1, planes=1, block_elems=3)[0][0] == 1
        assert launch(kernel, n_pairs=10_000, n=10_000, planes=1024, block_elems=4096)[0][0] >= 1


def test_registry_discovers_kernels_in_a_new_source(tmp_path):
    (tmp_path / "quant.cu").write_text(
        'extern "C" __global__ void matvec_q4_0(float* y, int n) {}\n'
        '// extern "C" __global__ void commented_out(int n) {}\n'
        'extern "C" __global__ void __launch_bounds__(128) gemm_q4_0(float* y, int n) {}\n'
    )
    assert registry.discover_sources(tmp_path) == {"quant.cu": ("matvec_q4_0", "gemm_q4_0")}


def test_unknown_source_names_the_known_ones():
    with pytest.raises(ValueError, match="norms.cu"):
        registry.source_file_name("no_such_source")


def test_philox_matches_the_random123_known_answers():
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    pi_counter, pi_key = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
    assert philox4x32_10(pi_counter, pi_key) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_philox_uniform_depends_only_on_seed_and_counter():
    draws = [philox_uniform(seed=42, counter=c) for c in range(1000)]
    assert draws == [philox_uniform(42, c) for c in range(1000)]
    assert all(0.0 <= u < 1.0 for u in draws) and abs(np.mean(draws) - 0.5) < 0.05
    assert philox_uniform(43, 0) != philox_uniform(42, 0)


def test_combine_refuses_more_chunks_than_default_shared_memory_holds():
    assert launch("attention_combine_f32", n_chunks=12_288)[2] == 48 * 1024
    with pytest.raises(ValueError, match="chunk_keys"):
        launch("attention_combine_f32", n_chunks=12_289)
