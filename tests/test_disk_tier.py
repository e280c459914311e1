"""The disk tier: block files that verify themselves, spills when host RAM is full, a cache that survives
a restart, and faults (corrupt, foreign, unwritable) that cost recomputation but never a wrong token."""
import asyncio

import numpy as np
import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.cache.block_mover import RecordingMover
from scheduler.cache.disk_tier import DiskEntry, DiskTier, cache_key
from scheduler.engine_loop import EngineLoop
from scheduler.cache.prefix_cache import PrefixCache
from scheduler.request import Request

SHAPE = (2, 1, 4, 3)


def _tier(root, key=b"k" * 16, capacity=8):
    return DiskTier(root, key, SHAPE, "float32", capacity)


def _entry(n=1):
    return DiskEntry(bytes([n]) * 16, b"\0" * 16, (5, 6, 7, n))


def test_block_file_round_trips(tmp_path):
    tier, k = _tier(tmp_path), np.arange(24, dtype=np.float32).reshape(SHAPE)
    tier.write(_entry(), k, -k)
    entry, k2, v2 = tier.read(_entry().digest)
    assert entry == _entry() and np.array_equal(k2, k) and np.array_equal(v2, -k)
    assert tier.scan() == [_entry()]


def test_corrupt_truncated_and_foreign_files_are_ignored_and_removed(tmp_path, caplog):
    tier, k = _tier(tmp_path), np.zeros(SHAPE, dtype=np.float32)
    for n in (1, 2, 3):
        tier.write(_entry(n), k, k)
    paths = sorted(tier.dir.glob("*.kv"))
    raw = bytearray(paths[0].read_bytes())
    raw[100] ^= 0xFF
    paths[0].write_bytes(bytes(raw))  # flipped bit
    paths[1].write_bytes(paths[1].read_bytes()[:50])  # truncated
    other = _tier(tmp_path, key=b"x" * 16)
    other.write(_entry(9), k, k)
    (tier.dir / f"{_entry(9).digest.hex()}.kv").write_bytes(next(other.dir.glob("*.kv")).read_bytes())
    with caplog.at_level("WARNING", logger="strata.cache.disk"):
        assert tier.scan() == [_entry(3)]
    assert "checksum mismatch" in caplog.text and len(list(tier.dir.glob("*.kv"))) == 1
    assert cache_key("model-a", (16,)) != cache_key("model-b", (16,))


def test_full_host_tier_spills_to_disk_and_a_hit_loads_it_back():
    mover = RecordingMover()
    cache = PrefixCache(num_blocks=2, block_size=4, host_blocks=1, disk_blocks=4, mover=mover)
    for first in (1, 2, 3):  # each needs both device blocks: earlier conversations move down the tiers
        tokens = [first] * 8
        cache.release(tokens, 8, cache.allocate(cache.match(tokens, 7), 8))
        cache.check_integrity()
    assert cache.stats["spills"] >= 1 and cache.stats["dropped_blocks"] == 0
    match = cache.match([1] * 8, 7)
    assert match.num_tokens == 7
    alloc = cache.allocate(match, 8)
    assert alloc.reused_by_tier["disk"] > 0 and cache.stats["disk_loads"] > 0
    cache.check_integrity()


def test_an_unreadable_disk_block_shortens_the_reuse_instead_of_failing():
    mover = RecordingMover()
    cache = PrefixCache(num_blocks=2, block_size=4, host_blocks=1, disk_blocks=4, mover=mover)
    for first in (1, 2, 3):
        tokens = [first] * 8
        cache.release(tokens, 8, cache.allocate(cache.match(tokens, 7), 8))
    mover.unreadable = {b.digest for b in cache.tiers.blocks("disk").values()}
    alloc = cache.allocate(cache.match([1] * 8, 7), 8)
    assert alloc is not None and alloc.cached_tokens < 7
    cache.check_integrity()


def test_a_failing_disk_write_drops_with_a_reason_and_keeps_integrity(caplog):
    mover = RecordingMover()
    mover.fail_saves = True
    cache = PrefixCache(num_blocks=2, block_size=4, host_blocks=1, disk_blocks=4, mover=mover)
    with caplog.at_level("INFO", logger="strata.cache"):
        for first in (1, 2, 3):
            tokens = [first] * 8
            cache.release(tokens, 8, cache.allocate(cache.match(tokens, 7), 8))
            cache.check_integrity()
    assert "disk write failed" in caplog.text and cache.stats["spills"] == 0


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("llama", seed=9, n_ctx=512)


def _serve_once(tiny, disk_root, prompt, cache_on=True, kv_type="f32"):
    model, tokenizer = tiny

    async def main():
        runner = ModelRunner(model, 64, 4, kv_type=kv_type)
        disk = DiskTier.for_layout(disk_root, "tiny", "numpy", runner.layout,
                                   256 * runner.layout.bytes_per_block) if cache_on else None
        loop = EngineLoop(runner, tokenizer, num_slots=1, prefill_chunk=16, max_queue=4, disk=disk,
                          prefix_cache=cache_on, integrity_checks=True)
        loop.start()
        tokens, last = [], None
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        async for delta in loop.submit(Request("r", prompt, params)):
            tokens += delta.token_ids
            last = delta
        await loop.shutdown(1)
        return tokens, last.usage.cached_tokens

    return asyncio.run(main())


def test_the_cache_survives_a_restart(tiny, tmp_path):
    first = list(range(20, 60))
    reply, cached = _serve_once(tiny, tmp_path, first)
    assert cached == 0
    second = first + reply + [7, 8, 9]  # the next turn, after a restart of the server
    reply2, cached2 = _serve_once(tiny, tmp_path, second)
    assert cached2 == len(first) + len(reply) - 1  # everything but the reply's last token (never computed)
    assert reply2 == _serve_once(tiny, tmp_path, second, cache_on=False)[0]


@pytest.mark.parametrize("kv_type", ["f16", "int8"])
def test_the_cache_survives_a_restart_with_compact_kv(tiny, tmp_path, kv_type):
    first = list(range(20, 60))
    reply, _ = _serve_once(tiny, tmp_path, first, kv_type=kv_type)
    second = first + reply + [7, 8, 9]
    reply2, cached2 = _serve_once(tiny, tmp_path, second, kv_type=kv_type)
    assert cached2 == len(first) + len(reply) - 1
    assert reply2 == _serve_once(tiny, tmp_path, second, cache_on=False, kv_type=kv_type)[0]


def test_a_restart_with_another_kv_type_never_reads_the_other_types_files(tiny, tmp_path):
    first = list(range(20, 60))
    reply, _ = _serve_once(tiny, tmp_path, first, kv_type="f32")
    second = first + reply + [7, 8, 9]
    reply_int8, cached = _serve_once(tiny, tmp_path, second, kv_type="int8")
    assert cached == 0  # a directory of its own: the f32 files are neither read nor removed
    assert reply_int8 == _serve_once(tiny, tmp_path, second, cache_on=False, kv_type="int8")[0]
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2
    _, cached_f32 = _serve_once(tiny, tmp_path, second, kv_type="f32")
    assert cached_f32 == len(first) + len(reply) - 1


def test_a_block_file_of_another_kv_type_is_refused_even_under_the_same_key(tmp_path):
    f32 = DiskTier(tmp_path, b"k" * 16, SHAPE, "float32", 8)
    f32.write(_entry(), np.ones(SHAPE, np.float32), np.ones(SHAPE, np.float32))
    int8 = DiskTier(tmp_path, b"k" * 16, SHAPE[:-1] + (SHAPE[-1] + 4,), "int8", 8)
    with pytest.raises(ValueError, match="size does not match"):
        int8.read(_entry().digest)
