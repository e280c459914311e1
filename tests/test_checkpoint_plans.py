"""Plans of a hybrid model's cache (state checkpoints weigh in the tiers' slots), on PrefixCache directly:
a prompt that fits the device pool is admitted even when the checkpoints its restored prefix carries
would not fit beside it (they stay behind, dropped; the matched state was read already), but a step never
drops held checkpoints to make room for those it takes inside its prompt (it goes on without them), and a
request short of room gives up its own checkpoint slots one at a time, branch points last."""
import numpy as np

from scheduler.cache.block_mover import RecordingMover
from scheduler.cache.checkpoint_adopt import park_order
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


def _two_block_conversation(host_blocks: int, disk_dir=None, disk_blocks: int = 0):
    """A cache of 8 blocks of 4 tokens, a state 2 slots, with one conversation of 8 tokens: states at 2
    (a message start), 7 (the prompt's end) and 8 (the reply's end: its release's)."""
    cache = PrefixCache(num_blocks=8, block_size=4, host_blocks=host_blocks, disk_blocks=disk_blocks,
                        mover=RecordingMover(),
                        checkpoints=Checkpoints(2, every_blocks=0, store=CheckpointStore(SHAPE, disk_dir, b"k")))
    tokens = [1] * 8
    alloc = cache.apply(cache.plan_allocate(cache.match(tokens, 7), 8, checkpoints=3))
    for position in (2, 7):
        cache.ckpt.take(alloc, position, np.full(SHAPE, position, np.float32))
    cache.apply(cache.plan_release(tokens, 8, alloc, final_state=np.full(SHAPE, 8, np.float32)))
    return cache, tokens


def test_a_tip_whose_states_outweigh_the_host_tier_is_parked_with_its_last_state():
    """Host tier 3 slots, a state 2: the conversation's tip block (weight 1 + 2 x 2) is parked with one
    state, the last (the reply's end, where the next turn goes on), though its gap to the prompt-end state
    before it is the smallest; the prompt-end one is dropped. The next turn then matches through the
    reply. Before (gap order alone): the reply-end state was dropped and every next turn recomputed from
    the prompt's end, or from further back when the tip held more states (tiny qwen3next under --pressure,
    short requests between turns: 1.077 -> 1.318 once states 8 and 16 tokens into a message came). Before
    that: the block was dropped with both (`device_drops`), and the conversation's second block with it."""
    cache, tokens = _two_block_conversation(host_blocks=3)
    first, second = cache.match(tokens).shared
    assert (first.checkpoints, second.checkpoints) == ({2}, {3, 4})  # device: 3 + 5 slots, the pool full
    assert [cache.ckpt.gap(second, k) for k in (3, 4)] == [5, 1]
    plan = cache.plan_allocate(cache.match([2] * 4, 3), 4)
    assert plan.parks == [second] and plan.device_drops == [] and plan.checkpoint_drops == [(second, 3)]
    cache.apply(plan)
    cache.check_integrity()
    assert second.on_host and second.checkpoints == {4} and first.on_device and first.checkpoints == {2}
    assert cache.ckpt.count("host") == 1 and cache.ckpt.count("device") == 1
    match = cache.match(tokens + [3] * 4, 11)
    assert match.num_tokens == 8 and match.checkpoint == (second, 4)
    assert float(cache.ckpt.read(second, 4)[0, 0, 0]) == 8


def test_a_victim_whose_states_outweigh_the_host_tier_goes_to_disk_whole(tmp_path):
    """With a disk tier, the tip block that the host tier (3 slots) cannot take with both its states goes
    straight to disk with both, no state dropped; the next turn and the same prompt again both find theirs.
    Before: parked with one state (the tip's reply-end state was dropped whenever the host had no leaf to
    spill for it yet: tiny qwen3next under --pressure, 1.318 on short requests between turns)."""
    cache, tokens = _two_block_conversation(host_blocks=3, disk_dir=tmp_path, disk_blocks=16)
    first, second = cache.match(tokens).shared
    assert (first.checkpoints, second.checkpoints) == ({2}, {3, 4})
    plan = cache.plan_allocate(cache.match([2] * 4, 3), 4)
    assert plan.spills == [second] and plan.parks == [] and plan.checkpoint_drops == []
    cache.apply(plan)
    cache.check_integrity()
    assert second.on_disk and second.checkpoints == {3, 4} and first.on_device and first.checkpoints == {2}
    assert cache.ckpt.count("disk") == 2 and cache.ckpt.count("host") == 0
    assert cache.match(tokens + [3] * 4, 11).checkpoint == (second, 4)
    assert cache.match(tokens, 7).checkpoint == (second, 3)
    assert [float(cache.ckpt.store.read_file((second.digest, k))[0, 0, 0]) for k in (3, 4)] == [7, 8]


def test_a_node_with_children_keeps_its_states_by_gap_a_tip_its_last_first():
    """`park_order`: a node a later block hangs from ranks its states by gap alone (the one whose loss
    costs least recompute goes first, whatever comes last on it); a tip puts its last state first, then
    the others by gap."""
    cache = PrefixCache(num_blocks=8, block_size=4, host_blocks=3,
                        checkpoints=Checkpoints(2, every_blocks=0, store=CheckpointStore(SHAPE)))
    tokens = [1] * 8
    alloc = cache.apply(cache.plan_allocate(cache.match(tokens, 7), 8, checkpoints=3))
    for position in (1, 3):
        cache.ckpt.take(alloc, position, np.full(SHAPE, position, np.float32))
    cache.apply(cache.plan_release(tokens, 8, alloc, final_state=np.full(SHAPE, 8, np.float32)))
    cache.check_integrity()
    first, second = cache.match(tokens).shared
    assert (first.checkpoints, second.checkpoints) == ({1, 3}, {4})
    assert [cache.ckpt.gap(first, k) for k in (1, 3)] == [1, 2] and cache.ckpt.gap(second, 4) == 5
    assert park_order(cache.ckpt, first) == [3, 1]  # not a tip: by gap (1's is the smaller)
    assert park_order(cache.ckpt, second) == [4]
    alloc = cache.apply(cache.plan_allocate(cache.match(tokens[:4] + [2] * 4, 7), 8, checkpoints=2))
    cache.ckpt.take(alloc, 5, np.full(SHAPE, 5, np.float32))
    cache.apply(cache.plan_release(tokens[:4] + [2] * 4, 8, alloc, final_state=np.full(SHAPE, 80, np.float32)))
    cache.check_integrity()
    other = cache.match(tokens[:4] + [2] * 4).shared[1]
    assert (first.checkpoints, other.checkpoints) == (set(), {1, 4})  # first's went for the request's room
    assert [cache.ckpt.gap(other, k) for k in (1, 4)] == [5, 3]
    assert park_order(cache.ckpt, other) == [4, 1]  # a tip: its last first (by gap alone: [1, 4])


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
