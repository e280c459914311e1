"""Conversations by name: while a conversation is active (a turn within the window), its blocks go after
one-off prompts' blocks, on the device and in host RAM; once inactive, plain LRU again. Tiny pools (block
size 4, 8 blocks), exact block ids and victims; /cache's per-conversation tokens per tier."""
import pytest

from scheduler.cache.conversation_activity import ACTIVE_WINDOW_S, first_block_name
from scheduler.cache.prefix_cache import PrefixCache

B = 4


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _cache(num_blocks=8, host_blocks=0, window_s=ACTIVE_WINDOW_S, disk_blocks=0):
    cache = PrefixCache(num_blocks=num_blocks, block_size=B, host_blocks=host_blocks, active_window_s=window_s,
                        disk_blocks=disk_blocks)
    cache.activity.clock = _Clock()
    return cache


def _turn(cache, tokens, key=None):
    """A finished turn: admitted, every token computed, released."""
    alloc = cache.allocate(cache.match(tokens, len(tokens) - 1, conversation=key), len(tokens))
    cache.release(tokens, len(tokens), alloc)
    cache.check_integrity()
    cache.activity.clock.now += 1
    return alloc


def _reused(cache, tokens):
    return cache.match(tokens + [0], len(tokens)).num_tokens


def _pressure(cache, tokens):
    """The plan of a new one-off prompt that needs room, then applied (and released)."""
    plan = cache.plan_allocate(cache.match(tokens, len(tokens) - 1), len(tokens))
    victims = [b.device_id for b in plan.parks + plan.device_drops]
    dropped = [b.tokens for b in plan.host_drops]
    alloc = cache.apply(plan)
    cache.release(tokens, len(tokens), alloc)
    cache.check_integrity()
    return victims, dropped, alloc.block_table


def test_an_active_conversation_outlives_a_newer_one_off_prompt():
    cache = _cache()
    assert _turn(cache, [1] * 8, key="session-A").block_table == [0, 1]
    assert _turn(cache, [2] * 8).block_table == [2, 3]  # newer, but a one-off prompt
    victims, _, table = _pressure(cache, [3] * 24)  # 6 blocks: 2 must go
    assert victims == [3, 2] and table == [4, 5, 6, 7, 3, 2]
    assert _reused(cache, [1] * 8) == 8 and _reused(cache, [2] * 8) == 0


def test_once_inactive_it_is_plain_lru_again():
    cache = _cache()
    _turn(cache, [1] * 8, key="session-A")
    _turn(cache, [2] * 8)
    cache.activity.clock.now += ACTIVE_WINDOW_S
    victims, _, table = _pressure(cache, [3] * 24)
    assert victims == [1, 0] and table == [4, 5, 6, 7, 1, 0]  # the older conversation goes first
    assert _reused(cache, [1] * 8) == 0 and _reused(cache, [2] * 8) == 8


def test_an_unnamed_conversation_is_active_from_its_second_turn():
    cache = _cache()
    _turn(cache, [1] * 8)
    assert _turn(cache, [1] * 8 + [5] * 4).block_table == [0, 1, 2]  # same first block: its second turn
    _turn(cache, [2] * 8)  # ids 3, 4
    victims, _, table = _pressure(cache, [3] * 20)
    assert victims == [4, 3] and table == [5, 6, 7, 4, 3]
    assert _reused(cache, [1] * 8 + [5] * 4) == 12


def test_a_single_unnamed_turn_is_a_one_off_prompt():
    cache = _cache()
    _turn(cache, [1] * 8)
    _turn(cache, [2] * 8)
    victims, _, _ = _pressure(cache, [3] * 24)
    assert victims == [1, 0]  # both one-off: least recently used first


def test_active_conversation_blocks_stay_longest_in_host_ram_too():
    cache = _cache(num_blocks=4, host_blocks=4)
    _turn(cache, [1] * 8, key="session-A")  # device 0, 1
    _turn(cache, [2] * 8)  # device 2, 3
    victims, dropped, _ = _pressure(cache, [3] * 16)  # every cached block parks: the one-off's first
    assert victims == [3, 2, 1, 0] and dropped == []
    victims, dropped, _ = _pressure(cache, [4] * 8)  # host RAM full: its one-off leaves are dropped
    assert len(victims) == 2 and dropped == [(2, 2, 2, 2), (2, 2, 2, 2)]
    assert _reused(cache, [1] * 8) == 8 and _reused(cache, [2] * 8) == 0


def test_in_host_ram_plain_lru_once_the_conversation_is_inactive():
    cache = _cache(num_blocks=4, host_blocks=4)
    _turn(cache, [1] * 8, key="session-A")
    _turn(cache, [2] * 8)
    _pressure(cache, [3] * 16)
    cache.activity.clock.now += ACTIVE_WINDOW_S
    _, dropped, _ = _pressure(cache, [4] * 8)
    assert dropped == [(1, 1, 1, 1), (1, 1, 1, 1)]
    assert _reused(cache, [1] * 8) == 0 and _reused(cache, [2] * 8) == 8


def test_a_window_of_zero_turns_the_preference_off():
    cache = _cache(window_s=0)
    _turn(cache, [1] * 8, key="session-A")
    _turn(cache, [2] * 8)
    assert _pressure(cache, [3] * 24)[0] == [1, 0]


def test_cache_lists_each_conversation_with_tokens_per_tier_and_last_use():
    cache = _cache(num_blocks=4, host_blocks=4)
    _turn(cache, [1] * 8, key="session-A")
    _turn(cache, [2] * 6)
    _pressure(cache, [3] * 16)  # parks both
    listed = cache.activity.snapshot(B)
    assert [{k: v for k, v in c.items() if k != "last_use_s"} for c in listed] == [
        {"key": first_block_name([3] * 16, B), "named": False, "active": False, "turns": 1,
         "tokens": {"device": 16, "host": 0, "disk": 0}},
        {"key": first_block_name([2] * 6, B), "named": False, "active": False, "turns": 1,
         "tokens": {"device": 0, "host": 6, "disk": 0}},
        {"key": "session-A", "named": True, "active": True, "turns": 1, "tokens": {"device": 0, "host": 8, "disk": 0}}]
    assert all(c["last_use_s"] > 0 for c in listed)


def test_unnamed_conversations_are_named_like_the_drop_log_names_them():
    from scheduler.cache.tree import conversation_id
    cache = _cache()
    _turn(cache, [7, 8, 9, 10, 11, 12])
    block = next(iter(cache.tiers.blocks("device").values()))
    assert first_block_name([7, 8, 9, 10, 11, 12], B) == conversation_id(block)


@pytest.mark.parametrize("key", ["session-A", None])
def test_a_preempted_request_is_not_a_turn(key):
    cache = _cache()
    tokens = [1] * 8
    alloc = cache.allocate(cache.match(tokens, 7, conversation=key), 8)
    cache.apply(cache.plan_release(tokens, 8, alloc, kind="preempt"))
    assert [c["turns"] for c in cache.activity.snapshot(B)] == [0]
    cache.check_integrity()


def test_cache_endpoint_joins_named_turn_stats_with_the_tokens_each_conversation_holds():
    from scheduler.conversations import ConversationLog
    cache = _cache()
    _turn(cache, [1] * 8, key="session-A")
    _turn(cache, [2] * 6)
    log = ConversationLog()
    log.record("session-A", "r1", prompt_tokens=8, cached_tokens=0)
    log.record("session-B", "r2", prompt_tokens=5, cached_tokens=0)  # its blocks are gone
    listed = {c["key"]: c for c in log.snapshot(cache.activity.snapshot(B))}
    assert set(listed) == {"session-A", "session-B", first_block_name([2] * 6, B)}
    a = listed["session-A"]
    assert (a["turns"], a["last_prompt_tokens"], a["active"], a["named"], a["tokens"]) == \
        (1, 8, True, True, {"device": 8, "host": 0, "disk": 0})
    assert listed["session-B"]["tokens"] == {"device": 0, "host": 0, "disk": 0} and not listed["session-B"]["active"]
    assert listed[first_block_name([2] * 6, B)]["tokens"]["device"] == 6


@pytest.mark.parametrize("idle_s, spilled, dropped", [(0, [3, 4], [2, 3]),  # active: one-off leaves leave disk
                                                      (ACTIVE_WINDOW_S, [1, 3], [1, 2])])  # inactive: LRU
def test_on_disk_too_an_active_conversation_outlives_one_off_prompts(idle_s, spilled, dropped):
    cache = _cache(num_blocks=2, host_blocks=2, disk_blocks=4)
    _turn(cache, [1] * 8, key="session-A")
    for first in (2, 3, 4):  # each turn moves the one before down a tier
        _turn(cache, [first] * 8)
    tiers = {t: sorted(b.tokens[0] for b in d.values())
             for t, d in (("device", cache.tiers.blocks("device")), ("host", cache.tiers.blocks("host")), ("disk", cache.tiers.blocks("disk")))}
    assert tiers == {"device": [4, 4], "host": [1, 3], "disk": [1, 2, 2, 3]}
    cache.activity.clock.now += idle_s
    plan = cache.plan_allocate(cache.match([5] * 8, 7), 8)  # the disk is full: two disk leaves must go
    assert [b.tokens[0] for b in plan.spills] == spilled and [b.tokens[0] for b in plan.disk_drops] == dropped
