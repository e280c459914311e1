"""lfm2 (short convolutions + attention) on numpy: config from GGUF metadata, the transformers reference,
and the path equalities that exercise the per-sequence conv state (batched == one by one, chunked ==
one shot, decode == prefill, a layer split == the whole model).

The reference (tests/data/lfm2_tiny_reference.json, scripts/make_lfm2_reference.py) is transformers'
Lfm2ForCausalLM on the seeded tiny GGUF, which the test regenerates with the recorded arguments.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.config import config_from_gguf
from engine.model import load_model
from engine.sequence import ModelRunner, Sequence
from scripts.make_lfm2_reference import tensor_digest
from tests.support.reference_helpers import assert_close_relative, prefill_and_decode
from tests.support.tiny_lfm2 import write_tiny_lfm2

REFERENCE = json.loads((Path(__file__).parent / "data" / "lfm2_tiny_reference.json").read_text())
BLOCK = 4


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("lfm2") / "tiny-lfm2.gguf"
    info = write_tiny_lfm2(path, **REFERENCE["gguf_args"])
    assert tensor_digest(info["tensors"]) == REFERENCE["tensor_sha256"], "tiny lfm2 writer changed"
    return load_model(path, NumpyBackend())[0]


def test_config_reads_the_layer_pattern_and_conv_length(reference_model):
    c = reference_model.config
    pattern = REFERENCE["gguf_args"]["pattern"]
    assert c.arch == "lfm2" and c.layer_is_recurrent == tuple(k == "c" for k in pattern)
    assert c.conv_kernel == 3 and c.n_kv_heads == 2 and c.has_qk_norm and not c.permuted_qk
    assert c.is_hybrid and c.recurrent_layers == tuple(i for i, k in enumerate(pattern) if k == "c")


def test_the_kv_pool_holds_the_attention_layers_only(reference_model):
    runner = ModelRunner(reference_model, num_blocks=8, block_size=BLOCK, layer_split=(2, 5))
    pattern = REFERENCE["gguf_args"]["pattern"]
    assert runner.layout.n_layers == pattern.count("a")
    parts = (pattern[:2], pattern[2:5], pattern[5:])
    assert [s.layout.n_layers for s in runner.stages] == [p.count("a") for p in parts]
    assert [len(s.state_pool.layers) for s in runner.stages] == [p.count("c") for p in parts]
    runner.check_stages()


@pytest.mark.parametrize("kv_type,row_bytes", [("f32", lambda hd: 4 * hd), ("f16", lambda hd: 2 * hd),
                                                ("int8", lambda hd: hd + 4)])
def test_kv_bytes_per_token_count_the_attention_layers_only_for_every_kv_type(reference_model, kv_type, row_bytes):
    c = reference_model.config
    runner = ModelRunner(reference_model, num_blocks=8, block_size=BLOCK, kv_type=kv_type)
    attention = REFERENCE["gguf_args"]["pattern"].count("a")
    assert 0 < attention == c.n_kv_layers < c.n_layers
    assert runner.layout.bytes_per_token == 2 * attention * c.n_kv_heads * row_bytes(c.head_dim)
    assert runner.layout.bytes_per_block == BLOCK * runner.layout.bytes_per_token
    assert sum(s.kv_pool.nbytes for s in runner.stages) == runner.layout.total_bytes


def test_config_rejects_a_head_count_list_of_the_wrong_length():
    fields = {"general.architecture": "lfm2", "lfm2.block_count": 3, "lfm2.embedding_length": 8,
              "lfm2.attention.head_count": 2, "lfm2.attention.head_count_kv": [0, 2],
              "lfm2.feed_forward_length": 16, "lfm2.shortconv.l_cache": 3}
    with pytest.raises(ValueError, match="per-layer"):
        config_from_gguf(fields, vocab_size=10)


@pytest.mark.parametrize("case", range(len(REFERENCE["prompts"])))
def test_logits_and_greedy_ids_match_transformers(reference_model, case):
    ref = REFERENCE["prompts"][case]
    assert len(ref["greedy_ids"]) >= 32
    logits, ids = prefill_and_decode(reference_model, ref["prompt_ids"], ref["greedy_ids"], chunk=8)
    assert_close_relative(logits, np.array(ref["logits"], dtype=np.float32), f"prompt {case}")
    assert ids == ref["greedy_ids"]


def test_chunked_prefill_and_a_layer_split_equal_one_shot(reference_model):
    ref = REFERENCE["prompts"][1]
    whole, _ = prefill_and_decode(reference_model, ref["prompt_ids"], ref["greedy_ids"][:4], chunk=100)
    for chunk, split in ((1, ()), (5, ()), (7, (2, 5))):
        other, _ = prefill_and_decode(reference_model, ref["prompt_ids"], ref["greedy_ids"][:4], chunk, split)
        np.testing.assert_allclose(other, whole, atol=1e-5, rtol=1e-5, err_msg=f"chunk {chunk} split {split}")


def test_batched_sequences_keep_their_own_state(reference_model):
    """Continuous batching: sequences that join at different steps, prefill beside decode."""
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((9, 4, 13))]
    runner = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK)
    seqs = [Sequence(p + [7, 8, 9]) for p in prompts]
    for seq in seqs:
        runner.ensure_blocks(seq, len(seq.token_ids))
    batched = {i: [] for i in range(3)}
    batched[0].append(runner.step([(seqs[0], 9)])[0])
    out = runner.step([(seqs[0], 1), (seqs[1], 4)])
    batched[0].append(out[0]), batched[1].append(out[1])
    out = runner.step([(seqs[0], 1), (seqs[1], 1), (seqs[2], 6)])
    [batched[i].append(out[i]) for i in range(3)]
    out = runner.step([(seqs[1], 1), (seqs[2], 7), (seqs[0], 1)])
    batched[1].append(out[0]), batched[2].append(out[1]), batched[0].append(out[2])
    for i, seq in enumerate(seqs):
        alone = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK)
        single = Sequence(list(seq.token_ids))
        alone.ensure_blocks(single, len(single.token_ids))
        logits = alone.step([(single, seq.num_computed)], all_logits=True)
        positions = {0: [8, 9, 10, 11], 1: [3, 4, 5], 2: [5, 12]}[i]
        np.testing.assert_allclose(np.array(batched[i]), logits[positions], atol=1e-5, rtol=1e-5)


def test_a_state_written_back_resumes_exactly(reference_model):
    """What the conversation cache relies on: read a sequence's state at position p, give it to a fresh
    sequence whose K/V blocks hold the same p tokens, and the next logits are those of the original."""
    ids = REFERENCE["prompts"][0]["prompt_ids"]
    runner = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK)
    seq = Sequence(list(ids))
    runner.ensure_blocks(seq, len(ids))
    runner.step([(seq, 12)])
    state = runner.states.read(seq)
    expected = runner.step([(seq, len(ids) - 12)], all_logits=True)
    resumed = Sequence(list(ids), block_table=list(seq.block_table), num_computed=12)
    runner.states.write(resumed, state)
    assert resumed.state_slot != seq.state_slot
    np.testing.assert_array_equal(runner.step([(resumed, len(ids) - 12)], all_logits=True), expected)


def test_states_captured_inside_a_chunk_are_those_after_their_position(reference_model):
    """A checkpoint inside a prefill chunk: the state after position p is copied out of the step."""
    ids = REFERENCE["prompts"][1]["prompt_ids"][:20]
    runner = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK, layer_split=(3,))
    seq = Sequence(list(ids))
    runner.ensure_blocks(seq, len(ids))
    runner.states.capture(seq, (7, 20))
    runner.step([(seq, 20)])
    captured = runner.states.take_captured(seq)
    np.testing.assert_array_equal(captured[20], runner.states.read(seq))
    cut = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK)
    other = Sequence(list(ids))
    cut.ensure_blocks(other, len(ids))
    cut.step([(other, 7)])
    # float32 round-off only: 7 rows and 20 rows take different BLAS paths through five layers
    np.testing.assert_allclose(captured[7], cut.states.read(other), atol=5e-5, rtol=1e-4)
    assert runner.states.take_captured(seq) == {}
