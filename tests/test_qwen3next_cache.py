"""qwen3next checkpoints that cost many blocks: at the reference model's size a DeltaNet state (conv rows and
the [Hv, dk, dv] matrix of 3 layers, 16.5 KiB) takes 9 blocks of 4 tokens, unlike the 1-block states of
tests/test_hybrid_cache.py (which runs every checkpoint test on lfm2 and a small qwen3next). The cache still
never changes a token, and still restores states, when each checkpoint weighs as much as 36 tokens of K/V."""
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.gguf_file import GGUFFile
from engine.model import load_model
from engine.tokenizer import Tokenizer
from tests.support.hybrid_runs import run_turns
from tests.support.tiny_qwen3next import write_tiny_qwen3next
from tests.support.turn_workloads import random_turns


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    path = tmp_path_factory.mktemp("q3n") / "tiny-qwen3next.gguf"
    write_tiny_qwen3next(path, seed=6, n_ctx=1024)  # the reference's sizes
    return load_model(path, NumpyBackend())[0], Tokenizer.from_gguf_fields(GGUFFile(path).fields)


def test_checkpoints_of_nine_blocks_are_counted_and_replies_do_not_change(heavy):
    turns = random_turns(5, conversations=3, count=12)
    on, usage, _, loop, _ = run_turns(heavy, turns, concurrency=3, num_blocks=160, host_blocks=60)
    off, _, _, _, _ = run_turns(heavy, turns, cache_on=False, num_blocks=160, concurrency=3)
    assert loop.cache.ckpt.units == 9
    assert on == off and sum(c for _, c, _ in usage) > 0 and loop.cache.ckpt.stats["restored"] > 0


def test_a_prefix_whose_checkpoints_cannot_all_come_back_is_reused_shorter_not_waited_for(tmp_path, caplog):
    """scripts/bench_cache.py's toggling-tools workload with a checkpoint every block (each costs 3 blocks of
    16 tokens): the sixth request matches 850 tokens whose parked blocks would bring more checkpoints back
    than the device holds, while nothing runs that could free any. It used to wait forever; now it reuses
    the longest shorter prefix that fits and every request completes. What the cache holds then decides
    whether it must step back at all (since the pressure fixes of the hybridcache branch keep more
    checkpoints on the device, it fits whole); when it does, the reuse is the shorter prefix the log names."""
    import threading

    from scripts.bench_cache import WORKLOADS, Replayer, load_bench_model
    from tests.support.server_harness import running_server

    caplog.set_level("INFO", logger="strata.scheduler")
    loaded = load_bench_model("tiny-qwen3next", str(tmp_path))
    with running_server(loaded, batch=2, ctx_size=1024, state_checkpoint_every=1) as (url, state):
        replayer = Replayer(url, loaded, state)
        worker = threading.Thread(target=WORKLOADS["toggling tool list"], args=(replayer, 6), daemon=True)
        worker.start()
        worker.join(90)  # the whole workload takes a few seconds
        assert not worker.is_alive(), f"request {len(replayer.rows) + 1} never completed"
    assert len(replayer.rows) == 6
    stepped = [r for r in caplog.records if "no device room to restore" in r.getMessage()]
    if stepped:
        fields = stepped[-1].fields
        assert 0 < fields["reused"] < fields["matched"]
        assert replayer.rows[5]["prompt"] - replayer.rows[5]["computed"] == fields["reused"]
