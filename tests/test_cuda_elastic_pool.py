"""The elastic KV pool on CUDA (engine/backends/cuda/kv_elastic.py): one reserved address range, physical chunks
mapped as it grows and unmapped as it shrinks, its segment-major layout read and written by the real kernels
(under the engine and a server: tests/test_cuda_elastic_engine.py).

Each runs on a GPU (marked `cuda`), on the numpy twins (tests/support/fake_cuda.py) and on the kernel sources under g++
(tests/support/fake_cuda_emulated.py), through the `cuda` fixture of tests/conftest.py; the fakes' virtual memory
(tests/support/fake_cuda_vmm.py) is real host virtual memory, so an access to an unmapped chunk cannot pass unseen.
"""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engine.backends.cuda.device import CudaError
from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import KVLayout
from tests.support.cuda_backend_checks import BLOCK, PAGE, REDUCE, SEG, assert_close, host_copy, launch_log, randn


def _elastic(cuda, layout, mapped_blocks):
    """An ElasticKVPool of SEG-block segments; on the fakes the granularity is one page, so a segment of a
    tiny layout is a chunk or two and the chunk arithmetic is exercised (a GPU keeps its 2 MiB)."""
    from engine.backends.cuda.kv_elastic import ElasticKVPool

    if cuda.test_driver is not None:
        cuda.test_driver.vmm_granularity = PAGE
    return ElasticKVPool(cuda, layout, mapped_blocks, seg_blocks=SEG)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "int8"])
def test_store_and_attention_over_blocks_in_several_segments_match_numpy(cuda, kv_type):
    layout = KVLayout(num_blocks=24, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8, kv_type=kv_type)
    pool, ref_pool, ref = _elastic(cuda, layout, 24), NumpyBackend().create_kv_pool(layout), NumpyBackend()
    rng = np.random.default_rng(11)
    tables = [np.array([21, 2, 13, 6]), np.array([0, 23]), np.array([9, 17, 4])]  # 6 segments, mixed
    seqs = [(60, 3, tables[0]), (20, 1, tables[1]), (40, 40, tables[2])]
    batch = build_batch([(list(range(n)), 0, t) for n, _, t in seqs], BLOCK, all_logits=True)
    for layer in range(2):
        k, v = (randn(rng, batch.num_tokens, 2, 8) for _ in range(2))
        cuda.store_kv(pool, layer, cuda.upload_activation(k), cuda.upload_activation(v), batch)
        ref.store_kv(ref_pool, layer, k, v, batch)
    for block in (21, 2, 13, 6, 0, 23, 9, 17, 4):
        for got, want in zip(cuda.read_block(pool, block), ref.read_block(ref_pool, block)):
            np.testing.assert_array_equal(got, want)  # the stored rows, scales included, byte for byte
    query = build_batch([(list(range(new)), n - new, t) for n, new, t in seqs], BLOCK)
    q = randn(rng, query.num_tokens, 4, 8)
    for layer in range(2):
        got = host_copy(cuda, cuda.attention(cuda.upload_activation(q), pool, layer, query, 0.25, 0))
        assert_close(got, ref.attention(q, ref_pool, layer, query, 0.25, 0), REDUCE)
    pool.close()


def test_long_decode_over_segments_takes_the_split_path_and_matches_numpy(cuda):
    layout = KVLayout(num_blocks=80, block_size=BLOCK, n_layers=1, n_kv_heads=2, head_dim=8, kv_type="f16")
    pool, ref_pool, ref = _elastic(cuda, layout, 80), NumpyBackend().create_kv_pool(layout), NumpyBackend()
    rng = np.random.default_rng(12)
    table = np.random.default_rng(13).permutation(80)[:70]  # 1,120 keys in 20 segments: three 512-key chunks
    batch = build_batch([(list(range(1110)), 0, table)], BLOCK, all_logits=True)
    k, v = (randn(rng, 1110, 2, 8) for _ in range(2))
    cuda.store_kv(pool, 0, cuda.upload_activation(k), cuda.upload_activation(v), batch)
    ref.store_kv(ref_pool, 0, k, v, batch)
    query = build_batch([([1], 1109, table)], BLOCK)
    q = randn(rng, 1, 4, 8)
    assert_close(host_copy(cuda, cuda.attention(cuda.upload_activation(q), pool, 0, query, 0.25, 0)),
                 ref.attention(q, ref_pool, 0, query, 0.25, 0), REDUCE)
    log = launch_log(cuda)
    assert log is None or "paged_attention_split_f16" in log
    pool.close()


@pytest.mark.parametrize("kv_type", ["f32", "int8"])
def test_block_moves_across_segments_keep_every_byte(cuda, kv_type):
    layout = KVLayout(num_blocks=12, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8, kv_type=kv_type)
    ref, rng = NumpyBackend(), np.random.default_rng(14)
    source = ref.create_kv_pool(layout)
    batch = build_batch([(list(range(12 * BLOCK)), 0, np.arange(12))], BLOCK)
    for layer in range(2):
        ref.store_kv(source, layer, *(randn(rng, 12 * BLOCK, 2, 8) * 3 for _ in range(2)), batch)
    blocks = {b: ref.read_block(source, b) for b in range(12)}
    pool, host = _elastic(cuda, layout, 12), cuda.create_host_pool(KVLayout(8, BLOCK, 2, 2, 8, kv_type))
    for b, (k, v) in blocks.items():
        cuda.write_block(pool, b, k, v)
    cuda.copy_blocks(pool, [(1, 10), (9, 2)])  # segment 0 -> 2, segment 2 -> 0
    cuda.park_blocks(pool, host, [(3, 0), (4, 1), (11, 2), (6, 3)])
    cuda.restore_blocks(host, pool, [(0, 7), (2, 5), (3, 8)])
    for block, want in ((10, 1), (2, 9), (7, 3), (5, 11), (8, 6), (0, 0), (11, 11)):
        for got_rows, want_rows in zip(cuda.read_block(pool, block), blocks[want]):
            np.testing.assert_array_equal(got_rows, want_rows)
    pool.close()


def test_growing_and_shrinking_keeps_addresses_and_the_bytes_of_the_ids_kept(cuda):
    layout = KVLayout(num_blocks=16, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8, kv_type="f16")
    rng = np.random.default_rng(15)
    pool = _elastic(cuda, layout, 4)
    fake = cuda.test_driver
    layer_bases = [(pool.layer_k(layer), pool.layer_v(layer)) for layer in range(2)]
    data = {b: (randn(rng, 2, 2, BLOCK, 8), randn(rng, 2, 2, BLOCK, 8)) for b in range(16)}
    stored = {}

    def write(ids):
        for b in ids:
            cuda.write_block(pool, b, *data[b])
            stored[b] = [cuda.read_block(pool, b)[i].copy() for i in (0, 1)]

    def check(ids):
        for b in ids:
            for got, want in zip(cuda.read_block(pool, b), stored[b]):
                np.testing.assert_array_equal(got, want)

    write(range(4))
    one_segment = pool.nbytes
    assert one_segment >= pool.segment_bytes and pool.num_blocks == 4
    cuda.release_kv_blocks(pool, 13)  # grow: segments 1..3 (13 ids need 4 segments)
    assert pool.nbytes >= 4 * pool.segment_bytes
    write(range(4, 13))
    check(range(13))
    cuda.release_kv_blocks(pool, 6)  # shrink to 2 segments: ids 8.. lose their memory
    if fake is not None:  # (a GPU's 2 MiB chunk holds all four of these tiny segments)
        assert pool.nbytes < 4 * pool.segment_bytes
        assert fake.physical_bytes == pool.nbytes == pool.vmm.mapped_bytes
    check(range(6))
    cuda.release_kv_blocks(pool, 16)
    check(range(6))
    write(range(6, 16))
    check(range(16))
    assert [(pool.layer_k(layer), pool.layer_v(layer)) for layer in range(2)] == layer_bases
    pool.close()
    if fake is not None:
        assert fake.physical_bytes == 0


def test_touching_a_shrunk_segment_fails_loudly(cuda):
    """After a shrink, a copy or a kernel that reads an id above the new size faults instead of reading stale
    or foreign memory: copies return CUDA_ERROR_ILLEGAL_ADDRESS, the numpy twins assert (the g++ kernels'
    segfault is the next test's)."""
    if cuda.test_driver is None:
        pytest.skip("on a GPU an illegal address poisons the context for the rest of the session")
    layout = KVLayout(num_blocks=12, block_size=BLOCK, n_layers=1, n_kv_heads=1, head_dim=8)
    pool = _elastic(cuda, layout, 12)
    cuda.release_kv_blocks(pool, 4)
    outside = pool.ptr + pool.bytes_for(4)
    staging = cuda.empty((16,))
    with pytest.raises(CudaError, match="cuMemcpyDtoDAsync"):
        cuda.device.dtod(staging.ptr, outside, 64, cuda.stream)
    from tests.support.fake_cuda_emulated import EmulatedDriver

    if not isinstance(cuda.test_driver, EmulatedDriver):  # the g++ kernel would take the whole process down
        with pytest.raises(AssertionError, match="unmapped device memory"):
            cuda.copy_blocks(pool, [(1, 9)])
    cuda.copy_blocks(pool, [(1, 3)])  # inside the pool: fine
    pool.close()


_CHILD = """
import sys
import numpy as np
import pytest
from engine.kv import KVLayout
from tests.support import fake_cuda_emulated
from tests.support.fake_cuda_vmm import FakeVmm

monkeypatch = pytest.MonkeyPatch()
FakeVmm.vmm_granularity = {page}
fake_cuda_emulated.install(monkeypatch, {build_dir!r})
from engine.backends.cuda.backend import CudaBackend
from engine.backends.cuda.kv_elastic import ElasticKVPool

backend = CudaBackend(graphs=False)
pool = ElasticKVPool(backend, KVLayout(12, 16, 1, 1, 8), 12, seg_blocks=4)
backend.release_kv_blocks(pool, 4)
backend.copy_blocks(pool, [(1, int(sys.argv[1]))])
backend.synchronize_stream(backend.copy_stream)
print("survived")
"""


def test_a_real_kernel_writing_into_a_shrunk_segment_is_killed(emulator_dir):
    """The g++-built copy_kv_blocks_f32 writing block 9 of a pool shrunk to 4 ids dies of SIGSEGV, as a GPU
    kernel dies of an illegal address; the same copy into block 3 (still mapped) completes."""
    from tests.support.kernel_emulator import compiler_available

    if not compiler_available():
        pytest.skip("g++ is needed to run the CUDA kernels on the CPU")
    (emulator_dir / "child").mkdir(exist_ok=True)
    script = textwrap.dedent(_CHILD).format(page=PAGE, build_dir=str(emulator_dir / "child"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(block):
        return subprocess.run([sys.executable, "-c", script, str(block)], cwd=root, capture_output=True, text=True,
                              timeout=240, env={**os.environ, "PYTHONFAULTHANDLER": ""})

    inside = run(3)
    assert inside.returncode == 0 and "survived" in inside.stdout, inside.stderr[-2000:]
    outside = run(9)
    assert outside.returncode == -signal.SIGSEGV and "survived" not in outside.stdout, outside.stderr[-2000:]


def test_a_pool_the_device_cannot_back_says_which_setting_to_change(cuda):
    if cuda.test_driver is None:
        pytest.skip("the fake's physical limit stands in for a full GPU")
    layout = KVLayout(num_blocks=12, block_size=BLOCK, n_layers=1, n_kv_heads=1, head_dim=8)
    pool = _elastic(cuda, layout, 4)
    cuda.test_driver.vmm_limit_bytes = pool.nbytes
    with pytest.raises(MemoryError, match="STRATA_CUDA_ARENA_MIB"):
        cuda.release_kv_blocks(pool, 12)
    assert pool.nbytes == cuda.test_driver.physical_bytes  # what was mapped stays mapped and counted
    pool.close()


def test_the_fakes_replace_the_driver_in_every_module_that_calls_it():
    """A backend module that binds cuda.device.driver at import and is missing from fake_cuda.driver_modules
    would keep the first test's fake (or the real driver) for good: cuda.vmm once did."""
    import re
    from pathlib import Path

    from tests.support.fake_cuda import driver_modules

    root = Path(__file__).resolve().parent.parent
    binding = re.compile(r"^from engine\.backends\.cuda\.device import .*\bdriver\b", re.M)
    callers = {".".join(p.relative_to(root).with_suffix("").parts)
               for p in (root / "engine" / "backends" / "cuda").rglob("*.py") if binding.search(p.read_text())}
    assert callers and callers <= {m.__name__ for m in driver_modules()}
