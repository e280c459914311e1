"""Plans of a hybrid model's cache (state checkpoints weigh in the tiers' slots), on PrefixCache directly:
a prompt that fits the device pool is admitted even when the checkpoints its restored prefix carries
would not fit beside it (they stay behind, dropped; the matched state was read already), but a step never
drops held checkpoints to make room for those it takes inside its prompt (it goes on without them), and a
request short of room gives up its own checkpoint slots one at a time, branch points last."""
import numpy as np

from scheduler.cache.tree import CachedBlock
from scheduler.cache.checkpoint_store import CheckpointStore
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.prefix_cache import PrefixCache
from tests.support.cache_requests import serve_request

SHAPE = (1, 1, 2)


def _cache(num_blocks, host_blocks):
    return PrefixCache(num_blocks=num_blocks, block_size=4, host_blocks=host_blocks,
                       checkpoints=Checkpoints(1, every_blocks=0, store=CheckpointStore(SHAPE)))


def test_a_restored_prefix_leaves_its_checkpoints_behind_when_they_do_not_fit_beside_the_prompt():
    cache = _cache(num_blocks=8, host_blocks=24)
    conversation = [1] * 16
    for end in (4, 8, 12, 16):  # four turns: a checkpoint at the end of each of its four blocks
        serve_request(cache, conversation[:end], checkpoint=True)
    serve_request(cache, [2] * 28, checkpoint=True)  # another conversation, the whole pool: the first one is parked
    blocks = cache.match(conversation).shared
    assert [b.checkpoints for b in blocks] == [{4}] * 4 and not any(b.on_device for b in blocks)
    prompt = conversation + [5] * 12  # 7 blocks of an 8-block pool; with its prefix's 4 checkpoints, 11
    match = cache.match(prompt, len(prompt) - 1)
    assert match.num_tokens == 16 and match.checkpoint == (blocks[-1], 4)
    plan = cache.plan_allocate(match, len(prompt))
    assert plan is not None and [(n.tokens, k) for n, k in plan.checkpoint_drops] == [(b.tokens, 4) for b in blocks[:3]]
    alloc = cache.apply(plan)
    assert alloc.cached_tokens == 16 and float(alloc.checkpoint_state[0, 0, 0]) == 16  # the state after token 16
    assert all(b.on_device for b in blocks) and [b.checkpoints for b in blocks] == [set(), set(), set(), {4}]
    cache.check_integrity()
    # The pool is full (7 blocks and the matched state): a state the next step would take inside the
    # prompt gets no room at the price of the one held.
    assert cache.plan_extend(alloc, len(prompt), checkpoints=1) is None
    assert cache.plan_extend(alloc, len(prompt)) is not None


def test_the_gap_of_a_checkpoint_is_what_a_branch_there_recomputes_without_it():
    root = CachedBlock((), None)
    a = CachedBlock((1,) * 4, root, checkpoints={4})
    b = CachedBlock((2,) * 4, a, checkpoints={1, 3})
    c = CachedBlock((3,) * 4, b)
    d = CachedBlock((4,) * 4, c, checkpoints={2})
    ckpt = Checkpoints(1)
    assert [ckpt.gap(a, 4), ckpt.gap(b, 1), ckpt.gap(b, 3), ckpt.gap(d, 2)] == [4, 1, 2, 2 + 4 + 1]


def test_a_request_short_of_room_gives_up_one_checkpoint_slot_at_a_time_branch_points_last():
    cache = _cache(num_blocks=16, host_blocks=0)
    alloc = cache.apply(cache.plan_allocate(cache.match([7] * 40, 39), 40, checkpoints=5))
    for position in (16, 20, 36):  # 20: where a message begins
        cache.ckpt.take(alloc, position, np.full(SHAPE, position, np.float32), branch_point=position == 20)
    ckpt = cache.ckpt
    ckpt.give_up_pending(alloc)  # an unused reservation goes first: the states stay
    assert (alloc.checkpoints_reserved, ckpt.reserved, sorted(alloc.pending_checkpoints)) == (4, 4, [16, 20, 36])
    ckpt.give_up_pending(alloc)
    assert (alloc.checkpoints_reserved, sorted(alloc.pending_checkpoints)) == (3, [20, 36])  # the earliest
    ckpt.give_up_pending(alloc)
    assert sorted(alloc.pending_checkpoints) == [20]  # the branch point last
    ckpt.give_up_pending(alloc)
    assert (alloc.checkpoints_reserved, sorted(alloc.pending_checkpoints)) == (1, [])  # the release's is last
    ckpt.give_up_pending(alloc)
    assert alloc.checkpoints_reserved == 0 == ckpt.reserved and ckpt.stats["dropped"] == 3
    cache.check_integrity()


def test_a_device_victim_whose_states_outweigh_the_host_tier_is_parked_with_those_that_fit():
    """Host tier 3 slots, a state 2: the victim block (weight 1 + 2 x 2) is parked with its most useful
    state; the other (the smaller gap to the one before it) is dropped. Before: the block was dropped with
    both (`device_drops`), and the conversation's second block with it."""
    cache = PrefixCache(num_blocks=8, block_size=4, host_blocks=3,
                        checkpoints=Checkpoints(2, every_blocks=0, store=CheckpointStore(SHAPE)))
    tokens = [1] * 8
    alloc = cache.apply(cache.plan_allocate(cache.match(tokens, 7), 8, checkpoints=3))
    for position in (2, 7):
        cache.ckpt.take(alloc, position, np.full(SHAPE, position, np.float32))
    cache.apply(cache.plan_release(tokens, 8, alloc, final_state=np.full(SHAPE, 8, np.float32)))
    first, second = cache.match(tokens).shared
    assert (first.checkpoints, second.checkpoints) == ({2}, {3, 4})  # device: 3 + 5 slots, the pool full
    assert [cache.ckpt.gap(second, k) for k in (3, 4)] == [5, 1]
    plan = cache.plan_allocate(cache.match([2] * 4, 3), 4)
    assert plan.parks == [second] and plan.device_drops == [] and plan.checkpoint_drops == [(second, 4)]
    cache.apply(plan)
    cache.check_integrity()
    assert second.on_host and second.checkpoints == {3} and first.on_device and first.checkpoints == {2}
    assert cache.ckpt.count("host") == 1 and cache.ckpt.count("device") == 1
    match = cache.match(tokens + [3] * 4, 11)
    assert match.num_tokens == 7 and match.checkpoint == (second, 3)
    assert float(cache.ckpt.read(second, 3)[0, 0, 0]) == 7


def test_a_parked_node_replaced_by_a_released_device_copy_brings_its_state_along():
    """A request recomputes a parked block's tokens (its match ended at the block's checkpoint inside
    it); its release's device copy replaces the parked node, whose state moves to the device (a free
    slot is there). Before, the state was forgotten."""
    cache = PrefixCache(num_blocks=10, block_size=4, host_blocks=8,
                        checkpoints=Checkpoints(1, every_blocks=0, store=CheckpointStore(SHAPE)))
    tokens = [1] * 4 + [2] * 4
    alloc = cache.apply(cache.plan_allocate(cache.match(tokens, 7), 8, checkpoints=2))
    cache.ckpt.take(alloc, 6, np.full(SHAPE, 6, np.float32))
    cache.apply(cache.plan_release(tokens, 8, alloc))
    match = cache.match(tokens, 7)
    first, second = match.shared[0], match.cow_source
    assert (first.checkpoints, second.checkpoints) == (set(), {2}) and second.parent is first
    other = [9] * 32  # 8 blocks: the leaf `second` (weight 2) is parked; 6 of them are released
    cache.apply(cache.plan_release(other, 24, cache.apply(cache.plan_allocate(cache.match(other, 31), 32))))
    assert second.on_host and first.on_device and cache.ckpt.count("host") == 1
    match = cache.match(tokens, 7)
    assert match.num_tokens == 6 and match.checkpoint == (second, 2) and match.cow_source is second
    alloc = cache.apply(cache.plan_allocate(match, 8))
    assert float(alloc.checkpoint_state[0, 0, 0]) == 6 and cache.tiers.free_slots("device") == 2
    cache.apply(cache.plan_release(tokens, 8, alloc))
    cache.check_integrity()
    assert first.children[(2,) * 4] is second and second.on_device and second.checkpoints == {2}
    assert (cache.ckpt.count("device"), cache.ckpt.count("host")) == (1, 0) and cache.ckpt.stats["dropped"] == 0
    assert float(cache.ckpt.read(second, 2)[0, 0, 0]) == 6 and cache.match(tokens, 7).checkpoint == (second, 2)
