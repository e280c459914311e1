"""A small memory service over a prefix cache with an elastic device pool, and a snapshot of the state a
refused or granted request may change: shared by tests/test_memory_service.py and test_holder_room.py."""
from scheduler.cache.block_mover import RecordingMover
from scheduler.cache.prefix_cache import PrefixCache
from scheduler.memory.admission import MemoryAdmission
from scheduler.memory.service import MemoryService

B = 4


def create_service(min_blocks=4, reserved=12, host_blocks=8):
    """(service, cache): a prefix cache of B-token blocks whose device pool holds min_blocks of `reserved` ids
    (segments of 4) and a host tier of host_blocks, under a MemoryService."""
    admission = MemoryAdmission(host_blocks, 64)
    admission.set_device_pool(min_blocks, reserved, 4)
    cache = PrefixCache(min_blocks, B, host_blocks=host_blocks, mover=RecordingMover(), admission=admission)
    return MemoryService(cache), cache


def cache_state(cache):
    """Everything a memory request may change: pool size, free ids and blocks of both tiers, the budgets held."""
    return (cache.num_blocks, cache.tiers.free_ids("device"), cache.tiers.free_ids("host"),
            {k: b.tokens for k, b in cache.tiers.blocks("device").items()},
            {k: b.tokens for k, b in cache.tiers.blocks("host").items()},
            cache.admission.host_committed_blocks, dict(cache.admission.held_device_bytes))
