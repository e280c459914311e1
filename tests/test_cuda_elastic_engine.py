"""The CUDA elastic K/V pool under the engine (tests/test_cuda_elastic_pool.py has the pool itself): seed 002's
sequence and the shrink plan's relocations through the engine loop with the numpy backend's tokens, a CUDA
server growing and shrinking its pool on request, and the device arena leaving the pool its room.

The engine tests run on a GPU (marked `cuda`), the numpy twins and the g++ kernels (the `cuda` fixture of
tests/conftest.py); the server and arena tests on the fake driver.
"""
import pytest

from engine.backends.reference.backend import NumpyBackend
from tests.support.cuda_backend_checks import PAGE, SEG


def _tiny_llama(cuda, tmp_path):
    """(CUDA model, numpy model, tokenizer) of seed 3's tiny llama, the CUDA one recording every size its
    elastic pools are given (4-block segments, so a shrink of these small pools unmaps memory)."""
    from engine.backends.cuda.kv_elastic import ElasticKVPool
    from engine.gguf_file import GGUFFile
    from engine.model import load_model
    from engine.tokenizer import Tokenizer
    from tests.support.tiny_gguf import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf", "llama", seed=3, n_ctx=512)
    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(tmp_path / "m.gguf").fields)
    if cuda.test_driver is not None:
        cuda.test_driver.vmm_granularity = PAGE
    cuda.kv_segment_blocks = SEG
    cuda.pool_sizes = []
    create = cuda.create_kv_pool

    def recording(layout, mapped_blocks=None):
        pool = create(layout, mapped_blocks)
        assert isinstance(pool, ElasticKVPool)
        resize = pool.resize
        pool.resize = lambda n, caller=None: (resize(n, caller), cuda.pool_sizes.append((n, pool.nbytes)))
        return pool

    cuda.create_kv_pool = recording
    return (load_model(tmp_path / "m.gguf", cuda)[0], load_model(tmp_path / "m.gguf", NumpyBackend())[0],
            tokenizer)


def test_seed_002_on_the_cuda_pool_gives_the_numpy_tokens(cuda, tmp_path):
    """Seed 002's sequence (tests/test_device_pool.py) on the CUDA backend's elastic pool: the pool grows
    by mapping, shrinks to 8 blocks by unmapping (the blocks above moved down or parked first), and the long
    conversation's next turn reuses every computed token with the tokens of the numpy backend."""
    from tests.support.pool_sequences import seed_002_sequence

    model, numpy_model, tokenizer = _tiny_llama(cuda, tmp_path)
    lengths = {"long_len": 160, "short_len": 112}  # 11 + 7 blocks of 16: the pool outgrows 8 blocks
    reply2, cached, first_turn = seed_002_sequence(model, tokenizer, True, device_blocks=8, **lengths)
    sizes = [n for n, _ in cuda.pool_sizes]
    shrink = sizes.index(8)
    assert max(sizes[:shrink]) > 8 and sizes[shrink + 1:] and cached == first_turn - 1  # grew, shrank, grew
    mapped = [nbytes for _, nbytes in cuda.pool_sizes]
    assert cuda.test_driver is None or mapped[shrink] < max(mapped[:shrink])  # the shrink gave chunks back
    assert reply2 == seed_002_sequence(numpy_model, tokenizer, False, **lengths)[0]


def test_blocks_moved_down_into_kept_segments_keep_their_bytes_on_cuda(cuda, tmp_path):
    """The shrink plan's relocations (device copies into free ids below the target) run before the chunks
    above are unmapped: the moved conversation's next turn reuses it with the numpy backend's tokens."""
    from tests.support.pool_sequences import moved_down_sequence

    model, numpy_model, tokenizer = _tiny_llama(cuda, tmp_path)
    reply2, cached, relocated, first_turn = moved_down_sequence(model, tokenizer, True, device_blocks=8)
    assert relocated >= 4 and cached == first_turn - 1 and cuda.pool_sizes[-1][0] == 10
    mapped = [nbytes for _, nbytes in cuda.pool_sizes]
    assert cuda.test_driver is None or mapped[-1] < max(mapped)  # the shrink gave chunks back
    assert reply2 == moved_down_sequence(numpy_model, tokenizer, False)[0]


def test_the_default_arena_leaves_the_elastic_pool_its_room(monkeypatch):
    """serve.build_state calls leave_outside_arena(--kv-cache-max-mib) before the device opens: the arena's
    default size (90% of the free memory) shrinks by that much, so the pool's chunks can be created."""
    from engine.backends.cuda import device as cuda_device
    from tests.support import fake_cuda

    fake_cuda.install(monkeypatch)
    monkeypatch.delenv(cuda_device.ARENA_ENV)
    monkeypatch.setattr(cuda_device, "_outside_arena", {"bytes": 0})
    free = fake_cuda.ARENA_BYTES  # what the fake's cuMemGetInfo reports free
    cuda_device.leave_outside_arena(100 * 2**20)
    assert cuda_device.get_device(0).arena_bytes == int(free * 0.9 - 100 * 2**20) // 2**20 * 2**20
    monkeypatch.setattr(cuda_device, "_devices", {})
    cuda_device.leave_outside_arena(free)
    with pytest.raises(ValueError, match="--kv-cache-max-mib"):
        cuda_device.get_device(0)


def test_a_cuda_server_grows_its_pool_and_shrinks_it_on_request(tmp_path, monkeypatch):
    """api/serve.build_state with --kv-cache-max-mib on the CUDA backend (the fake driver): the pool starts
    elastic at one slot's 8 blocks, grows by mapping chunks as two conversations arrive, shrinks on POST
    /cache/device-pool by unmapping them (nothing dropped), and the first conversation's next turn reuses it
    with the tokens of the same server on numpy."""
    from engine.backends.cuda.backend import CudaBackend
    from engine.loader import open_model
    from engine.sampling import SamplingParams
    from scheduler.request import Request
    from tests.support import fake_cuda
    from tests.support.fake_cuda_vmm import FakeVmm
    from tests.support.server_harness import run_on_app
    from tests.support.tiny_gguf import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", seed=3, n_ctx=512)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[(7 * i + k) % 200 + 20 for i in range(100)] for k in (0, 1)]  # 7 blocks each: the second grows

    def serve(loaded):
        async def work(state, client):
            async def turn(rid, prompt):
                deltas = [d async for d in state.engine.submit(Request(rid, prompt, params))]
                return [t for d in deltas for t in d.token_ids], deltas[-1].usage.cached_tokens

            replies = [await turn(f"c{k}", p) for k, p in enumerate(prompts)]
            grown = (await client.get("/cache")).json()
            shrunk = (await client.post("/cache/device-pool", json={"max_blocks": 8})).json()
            await client.post("/cache/device-pool", json={"max_blocks": 10_000})  # the ceiling back up
            again = await turn("c0-2", prompts[0] + replies[0][0] + [9, 8])
            return replies, again, grown, shrunk, (await client.get("/cache")).json()

        return run_on_app(loaded, work, ctx_size=128, kv_cache_max_mib=1, conversation_cache_mib=1)

    want = serve(open_model(str(path), backend=NumpyBackend()))
    fake = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(FakeVmm, "vmm_granularity", PAGE)  # a chunk per 64-block segment of this tiny model
    backend = CudaBackend(graphs=False)
    loaded = open_model(str(path), backend=backend)
    replies, again, grown, shrunk, after = got = serve(loaded)
    assert grown["device_total"] > 8 and grown["device_grows"] >= 1 and grown["parks"] == 0
    assert shrunk["device_blocks"] == 8 and not shrunk["stopped_by"] and after["dropped_blocks"] == 0
    assert again[1] == len(prompts[0]) + len(replies[0][0]) - 1  # every computed token of turn one reused
    assert got[:2] == want[:2]
    calls = [c[0] for c in fake.vmm_state().calls]
    assert calls.count("map") >= 2 and "unmap" in calls[calls.index("map") + 1:]  # grew by a chunk, gave it back
