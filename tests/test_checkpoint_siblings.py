"""A checkpoint on a sibling of a shared block serves the match (scheduler/cache/checkpoint_match.py): a request
that copied a partial block and extended it leaves the partial one, with the earlier reply's end state,
beside the full one it made; a later prompt that shares the full one reuses that state. Both tiny hybrid
models, through the engine loop with the integrity check after every step (tests/test_hybrid_cache.py)."""
import pytest

from tests.support.hybrid_runs import WRITERS, open_hybrid, run_turns


@pytest.fixture(scope="module", params=sorted(WRITERS))
def hybrid(tmp_path_factory, request):
    return open_hybrid(request.param, tmp_path_factory.mktemp(request.param))


def test_a_siblings_checkpoint_is_a_match_end(hybrid):
    first = list(range(30, 39))  # 9 prompt tokens + 3 replied: 11 computed, block 2 holds 3 (a partial block)
    turns = [(0, first, 3), (0, list(range(60, 66)), 3)]  # the same conversation goes on: block 2 fills up
    replies, usage, _, loop, history = run_turns(hybrid, turns, every=0)
    assert [c for _, c, _ in usage] == [0, 11]  # the second turn restored the reply's end (state at 11)
    branch = history[0][:14]  # shares blocks 0-2 (block 2 now the full one) and 2 tokens of block 3
    third = [(1, branch + list(range(90, 95)), 2)]
    _, usage3, _, loop3, _ = run_turns(hybrid, turns + third, every=0)
    partial = [n for n in _nodes(loop3.cache) if len(n.tokens) == 3 and 3 in n.checkpoints]
    assert len(partial) == 1 and len(partial[0].parent.children) == 2  # beside the full block it grew into
    assert [c for _, c, _ in usage3] == [0, 11, 11]  # not 8 (the first prompt's end, on the shared path)
    assert loop3.cache.stats["miss_no_checkpoint"] == 1  # 14 matched, 11 reused: said in the log


def _nodes(cache):
    stack, out = list(cache.tree.roots()), []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_the_most_useful_states_are_kept_when_room_is_short():
    """A trimmed history's first prompt (tiny qwen3next, a one-context pool) passes 90 (where the user
    message begins), 95 (periodic, moved to the line start after its role), 125 (the generation prompt)
    and 134 (its end) with room for two: the system message's boundary and the prompt's last message."""
    from scheduler.cache.checkpoint_spacing import most_useful

    assert most_useful([134, 90, 125, 95], 0, {90, 125, 134}) == [90, 125, 134, 95]
    assert most_useful([16, 20, 36], 0, {20}) == [20, 36, 16]  # equal gaps: the earlier goes first
    assert most_useful([140, 150], 137, set()) == [150, 140]  # gaps from where the request began
    assert most_useful([], 0, set()) == []
