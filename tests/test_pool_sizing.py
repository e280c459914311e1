"""--kv-cache-mib N | MIN:MAX | auto: the device pool's reserve and starting size, by the documented rule."""
from types import SimpleNamespace

import pytest

from engine.backends.capabilities import Capabilities
from engine.units import MIB
from scheduler.memory.sizing import AUTO_SHARE, MachineMemory, size_kv_pool

BLOCK = MIB // 2  # half a MiB per block: 2 blocks a MiB
NUMPY = SimpleNamespace(name="numpy", capabilities=Capabilities())


def _device(name: str, free_bytes: int | None) -> SimpleNamespace:
    return SimpleNamespace(name=name, capabilities=Capabilities(on_host=False), device_free_bytes=lambda: free_bytes)


def _size(spec, backend=NUMPY, machine=None, weight_mib=100, slot_blocks=8, batch=4):
    return size_kv_pool(spec, bytes_per_block=BLOCK, slot_blocks=slot_blocks, batch=batch, backend=backend,
                        weight_bytes=weight_mib * MIB, min_free_mib=1024, machine=machine)


def test_a_fixed_size_and_the_default():
    assert (_size((0, 0)).reserved_blocks, _size((0, 0)).min_blocks) == (32, None)  # --batch * --ctx-size
    assert (_size((20, 0)).reserved_blocks, _size((20, 0)).min_blocks) == (40, None)
    assert _size((1, 0)).reserved_blocks == 8  # never below one slot's context


def test_a_fractional_mib_is_taken_as_it_is():
    """scripts/bench_cache.py --pressure sizes a tiny model's pool in whole blocks of a few KiB."""
    from scheduler.memory.sizing import parse_kv_cache_mib

    assert parse_kv_cache_mib("10.5") == (10.5, 0) and parse_kv_cache_mib("12") == (12, 0)
    assert _size(parse_kv_cache_mib("10.75")).reserved_blocks == 21  # floor(10.75 MiB / 0.5 MiB)
    for bad in ("nan", "inf", "1e400"):
        with pytest.raises(ValueError, match="is not MiB"):
            parse_kv_cache_mib(bad)


def test_a_range_is_an_elastic_pool_from_min_to_max():
    pool = _size((20, 64))
    assert (pool.reserved_blocks, pool.min_blocks) == (128, 40) and pool.rule == "--kv-cache-mib 20:64"
    assert _size((0, 64)).min_blocks == 32  # MIN 0: it starts at --batch * --ctx-size
    assert _size((64, 64)).min_blocks is None  # MIN == MAX: fixed


def test_a_range_below_its_start_is_refused_and_cuda_takes_a_range_too():
    with pytest.raises(ValueError, match="below the starting pool"):
        _size((0, 8))  # 16 blocks < the default 32
    # CUDA maps the range's chunks as it grows (engine/backends/cuda/kv_elastic.py): the same pool as numpy's
    cuda = _size((20, 64), backend=_device("cuda", None))
    assert (cuda.reserved_blocks, cuda.min_blocks) == (128, 40)


def test_auto_on_numpy_takes_its_share_of_the_room_counting_the_engine_once():
    machine = MachineMemory(limit_bytes=8192 * MIB, in_use_bytes=2048 * MIB, source="cgroup v2 memory.max")
    pool = _size(None, machine=machine)
    room_mib = 8192 - 2048 - 100 - 1024  # headroom - weights - floor
    assert pool.reserved_blocks == int(room_mib * MIB * AUTO_SHARE) // BLOCK and pool.min_blocks == 32
    assert "cgroup v2 memory.max" in pool.rule and f"{room_mib} MiB room" in pool.rule


def test_auto_without_room_for_one_slot_says_what_to_lower():
    machine = MachineMemory(limit_bytes=1200 * MIB, in_use_bytes=0, source="MemAvailable")
    with pytest.raises(ValueError, match="lower --ctx-size"):
        _size(None, machine=machine, slot_blocks=400)


def test_auto_on_a_device_is_its_free_arena_less_a_margin():
    pool = _size(None, backend=_device("cuda", 10240 * MIB))
    assert pool.min_blocks is None and pool.reserved_blocks == (10240 - 1024) * MIB // BLOCK
    with pytest.raises(ValueError, match="give --kv-cache-mib N"):
        _size(None, backend=_device("other", None))
