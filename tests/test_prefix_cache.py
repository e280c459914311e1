"""The device-tier prefix cache: exact block ids, pins, copy-on-write partial hits, eviction order."""
import pytest

from scheduler.cache.prefix_cache import PrefixCache

B = 4


@pytest.fixture
def cache():
    c = PrefixCache(num_blocks=8, block_size=B)
    yield c
    c.check_integrity()


def _run(cache, tokens, total_tokens, computed=None):
    """Admit a request for `tokens`, pretend it computed `computed` tokens, release it."""
    alloc = cache.allocate(cache.match(tokens, len(tokens) - 1), total_tokens)
    cache.check_integrity()
    cache.release(tokens, len(tokens) if computed is None else computed, alloc)
    cache.check_integrity()
    return alloc


def test_first_request_gets_fresh_blocks_in_order_and_leaves_them_cached(cache):
    alloc = _run(cache, list(range(11)), total_tokens=12, computed=11)
    assert alloc.block_table == [0, 1, 2] and alloc.cached_tokens == 0 and alloc.copies == []
    assert cache.num_cached == 3  # 0..3, 4..7 full; 8..10 partial
    assert cache.tiers.num_free_ids("device") == 5


def test_extension_shares_full_blocks_and_copies_the_partial_tail(cache):
    _run(cache, list(range(11)), total_tokens=12, computed=11)
    tokens = list(range(11)) + [99, 98]
    match = cache.match(tokens, len(tokens) - 1)
    assert [b.device_id for b in match.shared] == [0, 1] and match.cow_source.device_id == 2
    alloc = cache.allocate(match, total_tokens=16)
    assert alloc.cached_tokens == 11 and alloc.block_table[:2] == [0, 1]
    assert alloc.copies == [(2, alloc.block_table[2])] and alloc.block_table[2] != 2
    cache.check_integrity()


def test_last_prompt_token_is_never_reused(cache):
    _run(cache, list(range(8)), total_tokens=8)
    match = cache.match(list(range(8)), 7)
    assert match.num_tokens == 7
    assert [b.device_id for b in match.shared] == [0] and match.cow_source.device_id == 1 and match.cow_tokens == 3


def test_prompt_diverging_inside_a_block_reuses_the_matching_tokens(cache):
    _run(cache, list(range(12)), total_tokens=12)
    match = cache.match([0, 1, 2, 3, 4, 5, 77, 78, 79], 8)
    assert match.num_tokens == 6 and match.cow_source.device_id == 1 and match.cow_tokens == 2


def test_two_conversations_share_their_common_head(cache):
    _run(cache, [1, 2, 3, 4, 10, 11, 12, 13, 14], total_tokens=9)
    alloc = _run(cache, [1, 2, 3, 4, 20, 21, 22, 23, 24], total_tokens=9)
    assert alloc.block_table[0] == 0 and alloc.cached_tokens == 4


def test_toggling_head_hits_both_variants(cache):
    tools_a, tools_b, rest = [1, 1, 1, 1], [2, 2, 2, 2], [5, 6, 7, 8, 9]
    _run(cache, tools_a + rest, total_tokens=9)
    _run(cache, tools_b + rest, total_tokens=9)
    assert cache.match(tools_a + rest + [0], 9).num_tokens == 9
    assert cache.match(tools_b + rest + [0], 9).num_tokens == 9


def test_identical_content_is_stored_once(cache):
    _run(cache, list(range(9)), total_tokens=9)
    cached_before = cache.num_cached
    _run(cache, list(range(9)), total_tokens=9)  # same prompt again: the copied tail dedupes into the old one
    assert cache.num_cached == cached_before


def test_pinned_blocks_are_never_evicted_and_failure_changes_nothing(cache):
    held = cache.allocate(cache.match(list(range(20)), 19), total_tokens=24)  # 6 of 8 blocks pinned
    assert held is not None
    free_before, cached_before = cache.tiers.num_free_ids("device"), cache.num_cached
    assert cache.allocate(cache.match([50, 51, 52], 2), total_tokens=12) is None  # needs 3, only 2 left
    assert (cache.tiers.num_free_ids("device"), cache.num_cached) == (free_before, cached_before)
    # exact state: the held request still owns blocks 0-5, the free queue is untouched
    assert held.block_table == [0, 1, 2, 3, 4, 5] and cache.tiers.num_owned == 6 and cache.tiers.free_ids("device") == [6, 7]


def test_eviction_takes_least_recently_used_leaves_first(cache):
    _run(cache, [1] * 8, total_tokens=8)  # blocks 0, 1  (a 2-block chain)
    _run(cache, [2] * 8, total_tokens=8)  # blocks 2, 3
    _run(cache, [3] * 8, total_tokens=8)  # blocks 4, 5
    _run(cache, [1] * 8 + [9], total_tokens=9)  # touches chain 1 again, block 6 for its tail
    alloc = cache.allocate(cache.match([7] * 12, 11), total_tokens=12)  # needs 3: 1 free + 2 evicted
    survivors = {b.tokens[0] for b in cache.tiers.blocks("device").values()}
    assert 2 not in survivors and 1 in survivors and 3 in survivors  # chain 2 was least recently used
    assert sorted(alloc.block_table) == [2, 3, 7]
    assert cache.stats["dropped_blocks"] == 2


def test_superseded_tail_is_evicted_before_a_live_conversation(cache):
    _run(cache, [1, 2, 3, 4, 5, 6], total_tokens=6)  # [1..4] + partial tail [5, 6]
    _run(cache, [8, 8, 8, 8, 8], total_tokens=5)  # another conversation's live tip, older use than what follows
    _run(cache, [1, 2, 3, 4, 5, 6, 7, 9], total_tokens=8)  # extends the tail: [5, 6] is superseded by [5, 6, 7, 9]
    _run(cache, [8, 8, 8, 8, 8], total_tokens=5)  # the other conversation is used last
    full = cache.allocate(cache.match([0] * 3, 2), total_tokens=4 * 4)  # forces one eviction
    assert full is not None
    tails = {b.tokens for b in cache.tiers.blocks("device").values()}
    assert (5, 6) not in tails and (8,) in tails


@pytest.fixture
def tiered():
    c = PrefixCache(num_blocks=4, block_size=B, host_blocks=3)
    yield c
    c.check_integrity()


def test_pressure_parks_unpinned_blocks_in_host_ram_tail_first(tiered):
    _run(tiered, [1] * 8, total_tokens=8)  # device blocks 0, 1
    alloc = _run(tiered, [2] * 12, total_tokens=16)  # needs all 4: parks conv 1's tail then head
    assert alloc.parks == [(1, 0), (0, 1)] and alloc.restores == []
    assert {b.tokens[0]: b.tier for b in tiered.tiers.blocks("host").values()} == {1: "host"}
    assert tiered.stats["dropped_blocks"] == 0


def test_a_hit_on_parked_blocks_restores_them(tiered):
    _run(tiered, [1] * 8, total_tokens=8)
    _run(tiered, [2] * 12, total_tokens=16)
    match = tiered.match([1] * 8 + [5], 8)
    assert match.num_tokens == 8 and all(not b.on_device for b in match.shared)
    alloc = tiered.allocate(match, total_tokens=12)
    assert {h for h, _ in alloc.restores} == {0, 1} and alloc.reused_by_tier == {"device": 0, "host": 8, "disk": 0}
    assert alloc.block_table[:2] == [d for _, d in sorted(alloc.restores, key=lambda p: -p[0])]
    tiered.check_integrity()


def test_full_host_tier_drops_the_least_valuable_host_leaf_and_says_so(tiered, caplog):
    _run(tiered, [1] * 8, total_tokens=8)
    _run(tiered, [2] * 8, total_tokens=8)
    with caplog.at_level("INFO", logger="strata.cache"):
        _run(tiered, [3] * 16, total_tokens=16)  # 4 blocks to move, 3 host slots: the least valuable dropped
    # conversation 1's tail goes straight from the device (parking it only to drop it would waste a copy)
    assert tiered.stats["parks"] == 3 and tiered.stats["dropped_blocks"] == 1
    assert sorted(b.tokens for b in tiered.tiers.blocks("host").values()) == [(1, 1, 1, 1), (2, 2, 2, 2), (2, 2, 2, 2)]
    assert any("evicted 4 cached tokens of conv-" in r.getMessage() for r in caplog.records)


def test_refused_allocation_leaves_every_block_where_it_was(tiered):
    held = tiered.allocate(tiered.match([9] * 12, 11), total_tokens=12)  # 3 of 4 device blocks owned
    _run(tiered, [1] * 3, total_tokens=4)  # fourth block cached, unpinned
    before = (dict(tiered.tiers.blocks("device")), dict(tiered.tiers.blocks("host")), tiered.stats.copy())
    assert tiered.allocate(tiered.match([7] * 8, 7), total_tokens=8) is None  # needs 2, only 1 movable
    assert (dict(tiered.tiers.blocks("device")), dict(tiered.tiers.blocks("host")), tiered.stats) == before
    assert held is not None


def test_different_salts_never_share_blocks(cache):
    tokens = list(range(12))
    alloc = cache.allocate(cache.match(tokens, 11, salt="tenant-a"), total_tokens=12)
    cache.release(tokens, 12, alloc)
    assert cache.match(tokens, 11, salt="tenant-b").num_tokens == 0
    assert cache.match(tokens, 11, salt="tenant-a").num_tokens == 11
    assert cache.match(tokens, 11).num_tokens == 0


def test_a_miss_after_divergence_names_the_position(cache):
    _run(cache, list(range(12)), total_tokens=12)
    prompt = list(range(6)) + [90, 91, 92, 93]
    miss = cache.explain_miss(prompt, cache.match(prompt, len(prompt) - 1))
    assert miss["cause"] == "diverged" and miss["position"] == 6


def test_a_miss_after_eviction_names_the_tier_and_reason(cache):
    _run(cache, [1] * 8, total_tokens=8)
    _run(cache, [2] * 32, total_tokens=32)  # needs all 8 blocks: conversation 1 is dropped
    miss = cache.explain_miss([1] * 8 + [3], cache.match([1] * 8 + [3], 8))
    assert miss["cause"] == "evicted" and miss["position"] == 0 and miss["tier"] == "device"
    assert "no room in the host tier" in miss["reason"]


def test_new_content_is_not_reported_as_a_miss(cache):
    _run(cache, [1] * 8, total_tokens=8)
    prompt = [1] * 8 + [4, 5, 6]  # extends what is cached: nothing was lost
    assert cache.explain_miss(prompt, cache.match(prompt, len(prompt) - 1)) is None


def test_a_full_budget_is_reported_once_per_episode_with_the_setting(caplog):
    cache = PrefixCache(num_blocks=2, block_size=B, host_blocks=1, block_bytes=2**20)
    with caplog.at_level("WARNING", logger="strata.cache"):
        for first in (1, 2, 3, 4):
            tokens = [first] * 8
            cache.release(tokens, 8, cache.allocate(cache.match(tokens, 7), 8))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "--conversation-cache-mib" in warnings[0]
    cache.check_integrity()


def test_a_request_needing_the_whole_pool_takes_over_its_partial_block_instead_of_waiting(cache):
    _run(cache, list(range(30)), total_tokens=32)  # 7 full blocks + a 2-token tail: the whole pool
    tail_block = cache.match(list(range(30)), 29).cow_source.device_id
    alloc = cache.allocate(cache.match(list(range(30)), 29), total_tokens=32)
    assert alloc is not None and alloc.cached_tokens == 29 and alloc.copies == []
    assert alloc.block_table[7] == tail_block  # the cached tail became the request's own block, no copy
    cache.check_integrity()
    cache.release(list(range(30)), 30, alloc)


def test_a_copy_source_with_children_is_never_taken_over(cache):
    _run(cache, list(range(30)), total_tokens=32)  # block 6 (tokens 24..27) has the tail block as child
    prompt = list(range(26)) + [99, 98, 97]  # diverges inside block 6
    match = cache.match(prompt, len(prompt) - 1)
    assert match.cow_source.device_id == 6 and match.cow_source.children
    alloc = cache.allocate(match, total_tokens=32)
    assert alloc.cached_tokens == 24 and alloc.copies == []  # gave up its 2 tokens instead of waiting
    cache.check_integrity()
