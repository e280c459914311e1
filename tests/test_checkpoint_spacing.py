"""--state-checkpoint-every auto: the spacing from the model's bytes (scheduler/cache/checkpoint_spacing.py), the
flag's parsing and validation, and the spacing the cache takes for both tiny hybrid models."""
import logging
import math
import re
from fractions import Fraction

import pytest

from api.config import ServerConfig
from api.config_load import load_config
from engine.backends.reference.backend import NumpyBackend
from engine.kv import KVLayout
from engine.model import load_model
from engine.qwen3next_config import DeltaNetShape
from engine.sequence import ModelRunner
from scheduler.cache.setup import create_cache
from scheduler.cache.checkpoint_spacing import auto_every_blocks, resolve_spacing
from tests.support.tiny_lfm2 import write_tiny_lfm2
from tests.support.tiny_qwen3next import write_tiny_qwen3next

MiB = 2**20


@pytest.mark.parametrize(("state_bytes", "block_bytes", "expected"), [
    (1536, 8192, 2),  # tiny lfm2: 1 block slot -> every 2 blocks
    (16896, 8192, 6),  # tiny qwen3next: 3 slots
    (8192, 8192, 2),  # exactly one block
    (8193, 8192, 4),  # one byte more takes a second slot
    (1, 10**9, 2),
])
def test_auto_spacing_is_twice_the_block_slots_a_checkpoint_takes(state_bytes, block_bytes, expected):
    assert auto_every_blocks(state_bytes, block_bytes) == expected
    units = math.ceil(state_bytes / block_bytes)
    assert units * block_bytes <= Fraction(1, 2) * expected * block_bytes  # the bound the rule promises
    assert units * block_bytes > Fraction(1, 2) * (expected - 1) * block_bytes  # and N is the least such


def test_another_share_changes_the_spacing():
    assert auto_every_blocks(16896, 8192, Fraction(1, 4)) == 12
    assert auto_every_blocks(16896, 8192, Fraction(1)) == 3
    assert auto_every_blocks(16896, 8192, Fraction(1, 3)) == 9


def test_published_models_spacing():
    """From the published configs (no download): LFM2-1.2B (10 conv layers of L 3 over d 2048, 6 attention
    layers of 8 KV heads x 64) and Qwen3-Next-80B-A3B (36 DeltaNet layers: 16 key / 32 value heads of 128,
    conv 4; 12 attention layers of 2 KV heads x 256)."""
    lfm2_state = 10 * (3 - 1) * 2048 * 4
    lfm2 = {t: KVLayout(1, 16, 6, 8, 64, t).bytes_per_block for t in ("f32", "f16", "int8")}
    assert (lfm2_state, lfm2["f16"]) == (160 * 1024, 192 * 1024)
    assert [auto_every_blocks(lfm2_state, lfm2[t]) for t in ("f32", "f16", "int8")] == [2, 2, 4]
    qwen_state = 36 * DeltaNetShape(16, 32, 128, 128, 4).state_floats * 4
    qwen = {t: KVLayout(1, 16, 12, 2, 256, t).bytes_per_block for t in ("f32", "f16", "int8")}
    assert qwen_state == 79036416 and round(qwen_state / MiB, 3) == 75.375  # 72 MiB of matrices + conv rows
    assert qwen["f16"] == 384 * 1024
    assert [auto_every_blocks(qwen_state, qwen[t]) for t in ("f32", "f16", "int8")] == [202, 402, 792]  # int8: 396 slots of 195 KiB


def test_an_integer_is_taken_as_given_and_zero_keeps_its_meaning():
    assert resolve_spacing(8, 16896, 8192, 16).every_blocks == 8
    assert resolve_spacing(0, 16896, 8192, 16).every_blocks == 0
    assert "none periodic" in resolve_spacing(0, 16896, 8192, 16).describe()
    auto = resolve_spacing(None, 16896, 8192, 16)
    assert auto.every_blocks == 6 and resolve_spacing("auto", 16896, 8192, 16) == auto
    assert "state: every 6 blocks (96 tokens; auto" in auto.describe() and "16896 bytes" in auto.describe()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spacing")
    write_tiny_lfm2(folder / "lfm2.gguf", seed=1, n_ctx=512)
    write_tiny_qwen3next(folder / "q3n.gguf", seed=1, n_ctx=512)
    return {name: load_model(folder / f"{name}.gguf", NumpyBackend())[0] for name in ("lfm2", "q3n")}


@pytest.mark.parametrize(("name", "requested", "expected"), [
    ("lfm2", None, 2), ("q3n", None, 6), ("lfm2", 8, 8), ("q3n", 8, 8), ("q3n", 0, 0)])
def test_the_cache_takes_the_models_spacing_and_logs_why(tiny_models, caplog, name, requested, expected):
    runner = ModelRunner(tiny_models[name], 64, 16)
    state_bytes = {"lfm2": 1536, "q3n": 16896}[name]
    assert (runner.states.state_bytes, runner.layout.bytes_per_block) == (state_bytes, 8192)
    with caplog.at_level(logging.INFO, logger="strata.cache"):
        cache = create_cache(runner, None, None, enabled=True, device_min_blocks=None, active_window_s=0,
                             checkpoint_every=requested)
    assert cache.ckpt.every_blocks == expected
    line = next(r for r in caplog.records if "checkpoints of the recurrent state" in r.getMessage())
    assert f"{state_bytes} bytes of recurrent state" in line.getMessage()
    assert line.fields["state_checkpoint_every"] == expected
    step = expected * 16
    assert cache.ckpt.positions(300, 16) == (sorted(range(step, 299, step)) if step else []) + [299]


@pytest.mark.parametrize(("argv", "blocks"), [
    ([], None), (["--state-checkpoint-every", "auto"], None), (["--state-checkpoint-every", "AUTO"], None),
    (["--state-checkpoint-every", "8"], 8), (["--state-checkpoint-every", "0"], 0),
    (["--state-checkpoint-every", " 12 "], 12)])
def test_flag_takes_auto_or_blocks(argv, blocks):
    cfg = load_config(argv, environ={})
    assert cfg.checkpoint_every_blocks == blocks
    assert ServerConfig().state_checkpoint_every == "auto"


@pytest.mark.parametrize("value", ["-1", "x", "1.5", "auto8", ""])
def test_a_bad_value_names_the_flag(value):
    with pytest.raises(ValueError, match=re.escape("--state-checkpoint-every must be auto or a whole number")):
        load_config(["--state-checkpoint-every", value], environ={})


def test_direct_construction_env_and_file(tmp_path):
    assert ServerConfig(state_checkpoint_every=3).checkpoint_every_blocks == 3  # an int becomes "3"
    with pytest.raises(ValueError, match="--state-checkpoint-every must be auto"):
        ServerConfig(state_checkpoint_every=-2)
    assert load_config([], environ={"STRATA_STATE_CHECKPOINT_EVERY": "5"}).checkpoint_every_blocks == 5
    path = tmp_path / "c.json"
    path.write_text('{"state-checkpoint-every": 4}')
    assert load_config(["--config", str(path)], environ={}).checkpoint_every_blocks == 4
    path.write_text('{"state-checkpoint-every": "auto"}')
    assert load_config(["--config", str(path)], environ={}).checkpoint_every_blocks is None


def test_periodic_checkpoints_move_to_the_nearest_line_start_within_half_a_period():
    from scheduler.cache.checkpoints import Checkpoints

    ckpt = Checkpoints(units=3, every_blocks=2)  # every 32 tokens of 16-token blocks
    assert ckpt.positions(100, 16) == [32, 64, 96, 99]
    lines = (5, 20, 30, 47, 60, 81)
    assert ckpt.positions(100, 16, line_starts=lines) == [30, 60, 81, 99]  # within 16 of 32, 64, 96
    assert ckpt.positions(100, 16, line_starts=(5, 10, 48)) == [32, 64, 96, 99]  # 48 is not > 64 - 16
    assert ckpt.positions(100, 16, line_starts=(5, 10, 48, 49)) == [32, 49, 96, 99]
    assert ckpt.positions(100, 16, hints=(60,), line_starts=(60,)) == [32, 60, 96, 99]  # one state, not two
    assert ckpt.positions(100, 16, line_starts=(35, 70)) == [35, 70, 96, 99]  # later ones too
    assert ckpt.positions(100, 16, line_starts=(28, 36)) == [28, 64, 96, 99]  # a tie: the earlier
    assert ckpt.positions(100, 16, line_starts=(97,)) == [32, 64, 97, 99]
    assert ckpt.positions(100, 16, line_starts=(99,)) == [32, 64, 96, 99]  # not at or past the prompt's end
    assert Checkpoints(units=3, every_blocks=0).positions(100, 16, line_starts=lines) == [99]


def test_line_starts_of_a_prompt(tmp_path):
    from api.checkpoint_hints import find_line_end_ids, line_starts
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer

    write_tiny_lfm2(tmp_path / "t.gguf", seed=1, n_ctx=64)
    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(tmp_path / "t.gguf").fields)
    ends = find_line_end_ids(tokenizer)
    newline = tokenizer.encode("\n", add_special=False)
    assert len(newline) == 1 and newline[0] in ends
    assert not ends & tokenizer.special_ids and tokenizer.encode("a", add_special=False)[0] not in ends
    ids = tokenizer.encode("ab\ncd\n\n\nef\ng", add_special=False)  # byte tokens: one per character
    assert line_starts(ids, ends) == (3, 6, 11)  # a blank-line run counts once, after its first newline
    assert line_starts(ids, frozenset()) == () and line_starts([], ends) == ()
    assert line_starts(tokenizer.encode("x\n", add_special=False), ends) == ()  # nothing after the last one


def test_the_server_passes_line_starts_for_a_hybrid_model(tmp_path):
    """build_state finds the line-end tokens of a hybrid model's vocabulary; a chat turn's Request carries
    where its prompt's lines begin (api/turn_runner.py)."""
    from api.branch_hints import branch_hints, content_guesses
    from api.checkpoint_hints import line_starts
    from api.serve import build_state
    from engine.loader import open_model

    write_tiny_qwen3next(tmp_path / "q3n.gguf", seed=1, n_ctx=512)
    loaded = open_model(str(tmp_path / "q3n.gguf"), max_positions=512)
    state = build_state(ServerConfig(port=0, batch=1, ctx_size=256, conversation_cache_mib=0), loaded)
    newline = loaded.tokenizer.encode("\n", add_special=False)[0]
    assert newline in state.line_end_ids
    assert state.engine.cache.ckpt.every_blocks == 10  # auto, the default (f16 K/V blocks: 6 on f32)
    ids = loaded.tokenizer.encode("a\nbc\nd", add_special=False)
    assert line_starts(ids, state.line_end_ids) == (2, 5)

    import httpx

    from tests.support.server_harness import running_server

    with running_server(loaded, ctx_size=256) as (url, live):
        seen, submit = [], live.engine.submit
        live.engine.submit = lambda request: seen.append(request) or submit(request)
        body = {"model": "q3n", "messages": [{"role": "user", "content": "one\ntwo\nthree"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    (request,) = seen
    assert request.line_starts == line_starts(request.prompt_ids, live.line_end_ids) and request.line_starts
    assert request.checkpoint_positions == branch_hints(request.prompt_ids, live.message_start_id, live.line_end_ids)
    assert request.checkpoint_guesses == content_guesses(request.prompt_ids, live.message_start_id, live.line_end_ids)
    assert set(request.line_starts) & set(request.checkpoint_positions)  # messages and their contents begin on a line
