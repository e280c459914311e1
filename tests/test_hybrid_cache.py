"""State checkpoints in the conversation cache, on the tiny hybrid models: lfm2 (short convs + attention) and
qwen3next (gated DeltaNet + gated attention + MoE), every test on each.

Through the engine loop with `check_integrity` after every admission and step: the cache never changes a
token (on == off, also under device / host / disk pressure), it computes exactly the ideal where the
conversations continue, the logits after restoring a checkpoint equal those computed from scratch with
the same chunks (after a park, a spill to disk and a restart), and a miss for want of a checkpoint says
where the nearest one was.
"""
import logging

import numpy as np
import pytest

from engine.sequence import ModelRunner, Sequence
from tests.support.hybrid_runs import BLOCK, WRITERS, open_hybrid, run_turns
from tests.support.turn_workloads import agent_turns, random_turns


@pytest.fixture(scope="module", params=sorted(WRITERS))
def hybrid(tmp_path_factory, request):
    return open_hybrid(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """The tiny lfm2 alone, for tests whose expected checkpoint positions are its own."""
    return open_hybrid("lfm2", tmp_path_factory.mktemp("lfm2-only"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_on_and_off_produce_identical_replies(hybrid, seed):
    turns = random_turns(seed)
    on, usage, _, loop, _ = run_turns(hybrid, turns, concurrency=3)
    off, usage_off, _, _, _ = run_turns(hybrid, turns, cache_on=False, concurrency=3)
    assert on == off and all(c == 0 for _, c, _ in usage_off)
    assert sum(c for _, c, _ in usage) > 0 and loop.cache.ckpt.stats["restored"] > 0


def test_pipeline_stages_and_batch_groups_keep_each_sequence_s_state(hybrid):
    """Three stages (each with its share of the state pools) and three groups in flight at once."""
    turns = random_turns(3, count=15)
    on, usage, _, loop, _ = run_turns(hybrid, turns, concurrency=3, layer_split=(1, 3), groups=3)
    off, _, _, _, _ = run_turns(hybrid, turns, cache_on=False, concurrency=3)
    assert on == off and sum(c for _, c, _ in usage) > 0


def test_agent_workload_computes_exactly_the_ideal(hybrid):
    """Continuing conversations, a toggling head and short one-offs: every reused prefix ends at a
    checkpoint (a reply's end), so nothing cached is recomputed."""
    _, usage, _, loop, _ = run_turns(hybrid, agent_turns(), concurrency=3)
    assert [p - c for p, c, _ in usage] == [ideal for _, _, ideal in usage]
    assert loop.cache.stats["miss_no_checkpoint"] == 0


@pytest.mark.parametrize("pressure", ["host", "disk", "write-behind", "small-host", "small-host-no-disk"])
def test_pressure_moves_checkpoints_with_their_blocks_and_never_changes_replies(hybrid, pressure, tmp_path,
                                                                                 monkeypatch):
    """small-host: a host tier of 2 slots, less than a block and its states: such blocks go to the disk
    tier whole, with all their states (scheduler/cache/room.py `park_with_states`), none parked without
    some; small-host-no-disk: without a disk tier they are parked with the states that fit, the rest
    dropped."""
    partial = _count_partial_parks(monkeypatch)
    turns = random_turns(7, conversations=5, count=30)
    extra = dict(num_blocks=70, host_blocks=30) if pressure == "host" else \
        dict(num_blocks=70, host_blocks=2) if pressure == "small-host-no-disk" else \
        dict(num_blocks=70, host_blocks=2 if pressure == "small-host" else 8, disk_root=tmp_path, disk_blocks=400)
    if pressure == "write-behind":  # K/V files written while serving: a spill of such a block writes only
        extra.update(disk_blocks=120, write_behind_mib_s=10_000.0)  # its checkpoints' files
    on, usage, _, loop, _ = run_turns(hybrid, turns, concurrency=3, **extra)
    off, _, _, _, _ = run_turns(hybrid, turns, cache_on=False, num_blocks=70, concurrency=3)
    assert on == off
    stats, ckpt = loop.cache.stats, loop.cache.ckpt.stats
    assert stats["parks"] > 0 and stats["restores"] > 0 and ckpt["restored"] > 0
    if pressure not in ("host", "small-host-no-disk"):
        assert stats["spills"] > 0 and stats["disk_loads"] > 0
    if pressure == "write-behind":
        assert loop.write_behind.written_blocks > 0, "nothing was written behind"
    if pressure == "small-host":
        assert not partial and ckpt["restored"] > 0, "a block was parked without some of its states"
    if pressure == "small-host-no-disk":
        assert partial, "no block was parked with only some of its states"


def _count_partial_parks(monkeypatch) -> list[int]:
    """Records, for each device victim parked without some of its states, how many it kept."""
    import scheduler.cache.room as room
    found, park = [], room.park_with_states

    def counting(view, plan, host, victim):
        before = len(plan.checkpoint_drops)
        park(view, plan, host, victim)
        if len(plan.checkpoint_drops) > before:
            found.append(len(victim.checkpoints) - (len(plan.checkpoint_drops) - before))
    monkeypatch.setattr(room, "park_with_states", counting)
    return found


def _continuous_logits(model, num_blocks, tokens, first_steps, second_steps):
    """The reference: one sequence whose recurrent state is never saved or restored, computed in the same
    chunks over the same block tables as the two turns; between them its K/V blocks are copied to the
    second turn's ids (byte copies, as the cache's restores and copy-on-write are), so the attention reads
    the same runs of blocks and only the state's path differs. Logits of each second-turn step."""
    runner = ModelRunner(model, num_blocks, BLOCK)
    seq = Sequence(list(tokens))
    for n, _, table in first_steps:
        seq.block_table = table
        runner.step([(seq, n)])
    first_table, second_table = first_steps[-1][2], second_steps[0][2]
    used = -(-seq.num_computed // BLOCK)
    blocks = [runner.read_block("device", b) for b in first_table[:used]]
    for b, (k, v) in zip(second_table[:used], blocks):
        runner.write_block(b, k, v)
    rows = []
    for n, _, table in second_steps:
        seq.block_table = table
        rows.append(runner.step([(seq, n)])[0])
    return rows


@pytest.mark.parametrize("where", ["device", "host", "disk", "restart"])
def test_logits_after_a_restored_checkpoint_equal_computing_from_scratch(hybrid, where, tmp_path):
    """Conversation 0's second turn restores the checkpoint at its first reply's end: from the device, after
    a park (other conversations fill the pool), after a spill to disk, or after a restart of the server.
    Its logits are bitwise those of one sequence that carried its state all along (_continuous_logits)."""
    model, _ = hybrid
    first = [(0, list(range(20, 49)), 6)]
    others = [(c, list(range(60 + 10 * c, 100 + 10 * c)), 3) for c in (1, 2, 3, 4)]
    second = [(0, [5, 6, 7, 8, 9, 10, 11], 4)]
    disk = dict(disk_root=tmp_path, disk_blocks=400)
    setup = {"device": dict(), "host": dict(num_blocks=40, host_blocks=60),
             "disk": dict(num_blocks=40, host_blocks=4, **disk), "restart": disk}[where]
    if where == "restart":
        _, _, steps1, _, history = run_turns(hybrid, first, **setup)
        _, usage, steps2, loop, _ = run_turns(hybrid, second, history=history, **setup)
        steps = steps1 + [(f"b{rid}", *rest) for rid, *rest in steps2]
        second_id = "bt0"
    else:
        turns = first + (others if where != "device" else []) + second
        _, usage, steps, loop, history = run_turns(hybrid, turns, **setup)
        second_id = f"t{len(turns) - 1}"
    prompt_len, cached, _ = usage[-1]
    assert cached == 29 + 6 - 1  # the first turn's prompt and reply, less the reply's last token
    assert loop.cache.ckpt.stats["restored"] >= 1
    if where in ("host", "disk"):
        assert loop.cache.stats["parks" if where == "host" else "disk_loads"] > 0
    first_steps = [(n, row, table) for rid, n, row, table in steps if rid == "t0"]
    second_steps = [(n, row, table) for rid, n, row, table in steps if rid == second_id]
    tokens = history[0]
    assert sum(n for n, _, _ in first_steps + second_steps) == cached + sum(n for n, _, _ in second_steps) \
        == len(tokens) - 1
    expected = _continuous_logits(model, setup.get("num_blocks", 400), tokens, first_steps, second_steps)
    for (_, row, _), want in zip(second_steps, expected, strict=True):
        np.testing.assert_array_equal(row, want)


def test_a_miss_for_want_of_a_checkpoint_says_where_the_nearest_one_is(hybrid, caplog):
    """Two prompts share 37 tokens; the first one's checkpoints are at 8, 16, ... (every 2 blocks of 4),
    its prompt end and its reply end: the second reuses 32 tokens and the log says why not 37."""
    shared = list(range(30, 67))
    turns = [(0, shared + [200, 201, 202, 203, 204], 2), (1, shared + [210, 211], 2)]
    with caplog.at_level(logging.INFO, logger="strata"):
        _, usage, _, loop, _ = run_turns(hybrid, turns, every=2)
    assert usage[1][1] == 32
    assert loop.cache.stats["miss_no_checkpoint"] == 1
    lines = [r.getMessage() for r in caplog.records if "state checkpoint" in r.getMessage()]
    assert lines == ["prompt matched 37 cached tokens, but the nearest state checkpoint is at token 32: "
                     "recomputing from there (a hybrid model's recurrent state cannot be cut from a later one; "
                     "--state-checkpoint-every keeps more)"]


def test_where_a_prompt_leaves_a_cached_sequence_it_leaves_a_checkpoint(hybrid):
    """The second prompt branches off the first at token 21, between checkpoints: it recomputes from the
    start (qwen3next) or from a state window (lfm2: 6 tokens, engine/state_window.py) but keeps the state at
    21, so a third one branching there reuses exactly 21 tokens."""
    shared = list(range(40, 61))
    turns = [(c, shared + [100 + 10 * c + i for i in range(9)], 2) for c in range(3)]
    _, usage, _, loop, _ = run_turns(hybrid, turns, every=0)
    window = loop.cache.ckpt.window_tokens
    assert window == (6 if hybrid[0].config.arch == "lfm2" else 0)
    assert [c for _, c, _ in usage] == [0, 21 - window if window else 0, 21]
    assert loop.cache.stats["miss_no_checkpoint"] == (0 if window else 1)
    assert loop.cache.stats["state_windows"] == (1 if window else 0)


def test_checkpoint_hints_of_a_request_are_kept(hybrid):
    """A request's checkpoint_positions (the API passes where its messages begin) become checkpoints."""
    first = list(range(40, 70))
    turns = [(0, first, 2), (1, first[:13] + [5, 6, 7], 2)]
    _, usage, _, _, _ = run_turns(hybrid, turns, every=0, hints={0: (11,)})
    assert usage[1][1] == 11


def test_the_message_start_token_of_a_chatml_template_marks_each_message(hybrid):
    from api.checkpoint_hints import find_message_start_id, message_starts
    from engine.chat_template import ChatTemplate
    from tests.support.tiny_gguf import CHATML_TEMPLATE

    tokenizer = hybrid[1]
    template = ChatTemplate(CHATML_TEMPLATE, "tiny-lfm2")
    start = find_message_start_id(template, tokenizer)
    assert start == tokenizer.encode("<|im_start|>", add_special=False)[0]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tokenizer.encode(template.render(messages), add_special=False)
    assert message_starts(ids, start) == tuple(i for i, t in enumerate(ids) if t == start and i > 0)
    assert len(message_starts(ids, start)) == 2  # the user message and the generation prompt
    assert message_starts(ids, None) == ()


def test_the_same_prompt_again_computes_only_its_last_token_from_a_checkpoint_inside_a_chunk(hybrid):
    """The checkpoint at prompt_len - 1 is captured inside the last prefill chunk (chunks of 8: 24-28);
    the retry restores it, computes the last token alone and gets the first request's logits (up to the
    round-off of a 5-row step against a 1-row one)."""
    prompt = list(range(20, 49))
    _, usage, steps, _, _ = run_turns(hybrid, [(0, prompt, 3), (1, prompt, 3)], every=0)
    assert usage[1][1] == len(prompt) - 1
    first = [row for rid, n, row, _ in steps if rid == "t0"][len(range(0, 29, 8)) - 1]
    retry = [(n, row) for rid, n, row, _ in steps if rid == "t1"]
    assert retry[0][0] == 1
    np.testing.assert_allclose(retry[0][1], first, atol=1e-5, rtol=1e-5)


def test_a_request_that_fills_the_pool_goes_on_without_room_for_checkpoints(hybrid):
    """30 prompt + 6 reply tokens in a pool of exactly 9 blocks of 4: no slot is left for a checkpoint, so
    the request is admitted and steps without one (it must not wait or preempt itself forever)."""
    turns = [(0, list(range(20, 50)), 6)]
    on, usage, _, loop, _ = run_turns(hybrid, turns, num_blocks=9, every=1, hints={0: (4, 8, 12)})
    off, _, _, _, _ = run_turns(hybrid, turns, num_blocks=9, cache_on=False)
    assert on == off and loop.num_preemptions == 0


def _checkpoint_positions(cache):
    return sorted((len(node.path()) - 1) * BLOCK + k for node in cache.ckpt.nodes.values() for k in node.checkpoints)


def test_a_step_short_of_slots_keeps_as_many_checkpoints_as_fit_branch_points_first(lfm2):
    """30 prompt tokens in one chunk (8 blocks) in a 12-block pool, a checkpoint wanted at every block: 3
    slots are left beside the release's, so the step keeps 3 of its 8 (the message start at 12 and the
    prompt's end before the every-block ones, then the latest); the first reply block then needs a slot
    back, and the every-block one goes (branch points last)."""
    turns = [(0, list(range(20, 50)), 6)]
    on, _, _, loop, _ = run_turns(lfm2, turns, num_blocks=12, every=1, chunk=32, hints={0: (12,)})
    off, _, _, _, _ = run_turns(lfm2, turns, num_blocks=12, cache_on=False, chunk=32)
    assert on == off and loop.num_preemptions == 0
    assert _checkpoint_positions(loop.cache) == [12, 29, 35]  # and the reply's end (30 + 6 - 1)
    assert loop.cache.ckpt.stats["taken"] == 3 and loop.cache.ckpt.stats["dropped"] == 1


def test_a_step_short_of_slots_gives_up_a_guess_before_a_branch_point(lfm2):
    """As above without periodic states: the hint at 4, the guess at 20 (api/branch_hints.py, 8 or 16 tokens
    into a message) and the prompt's end at 29 fit the 3 slots; the reply's block takes one back. By gaps
    alone the hint would go (4 after the start, against 16 and 9); a guess ranks with the periodic states,
    so it goes first."""
    turns = [(0, list(range(20, 50)), 6)]
    on, _, _, loop, _ = run_turns(lfm2, turns, num_blocks=12, every=0, chunk=32, hints={0: (4,)}, guesses={0: (20,)})
    off, _, _, _, _ = run_turns(lfm2, turns, num_blocks=12, cache_on=False, chunk=32)
    assert on == off and loop.num_preemptions == 0
    assert _checkpoint_positions(loop.cache) == [4, 29, 35]
    assert loop.cache.ckpt.stats["taken"] == 3 and loop.cache.ckpt.stats["dropped"] == 1
    as_hint, _, _, loop, _ = run_turns(lfm2, turns, num_blocks=12, every=0, chunk=32, hints={0: (4, 20)})
    assert as_hint == off and _checkpoint_positions(loop.cache) == [20, 29, 35]


def test_a_corrupt_checkpoint_file_only_shortens_the_match(hybrid, tmp_path):
    """After a restart the checkpoint files are corrupted (after the start-up scan): the second turn's
    match falls back to an earlier checkpoint (or none), recomputes the rest and replies as cache off."""
    first, second = [(0, list(range(20, 49)), 6)], [(0, [5, 6, 7, 8], 4)]
    _, _, _, _, history = run_turns(hybrid, first, disk_root=tmp_path, every=2)
    saved = {conv: list(tokens) for conv, tokens in history.items()}

    def corrupt(loop):
        files = list(loop.cache.ckpt.store.dir.glob("*.state"))
        assert files and loop.cache.ckpt.count("disk") == len(files)
        for path in files:
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(bytes(raw))

    on, usage, _, loop, _ = run_turns(hybrid, second, disk_root=tmp_path, every=2, history=history, on_start=corrupt)
    off, _, _, _, _ = run_turns(hybrid, second, cache_on=False, history=saved)
    assert on == off
    # Every checkpoint on the path was unreadable: nothing reusable, or (lfm2) each unreadable one shortens
    # the match back to the next (34, 28, 24), until a window is cheaper: 24 less its 6 tokens.
    assert usage[0][1] == (24 - 6 if loop.cache.ckpt.window_tokens else 0)
    assert loop.cache.ckpt.count("disk") == 0  # and lfm2 loads the 6 blocks of those 24 tokens
    assert loop.cache.stats["disk_loads"] == (24 // BLOCK if loop.cache.ckpt.window_tokens else 0)
