"""qwen3next (gated DeltaNet + gated attention + MoE) on numpy: the GGUF metadata, transformers' reference,
and the path equalities that exercise the per-sequence conv and delta-rule state (chunked == one shot,
decode == prefill, batched == one by one, split stages == the whole model, a written-back state resumes).

The reference (tests/data/qwen3next_tiny_reference.json, scripts/make_qwen3next_reference.py) is transformers'
Qwen3NextForCausalLM on a seeded tiny random model; tests/data/qwen3next_tiny.gguf is what llama.cpp's own
convert_hf_to_gguf.py made of it (committed, sha256 checked).
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from engine.backends.cpu.backend import QuantizedNumpyBackend
from engine.backends.reference.backend import NumpyBackend
from engine.config import config_from_gguf
from engine.delta_rule import chunked, l2_normalize, recurrent_step, unit_lower_inverse
from engine.gguf_file import GGUFFile
from engine.model import load_model
from engine.sequence import ModelRunner, Sequence
from tests.support.reference_helpers import assert_close_relative, prefill_and_decode
from tests.support.tiny_qwen3next import write_tiny_qwen3next

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "qwen3next_tiny_reference.json").read_text())
GGUF_PATH = DATA / REFERENCE["gguf"]
BLOCK = 4
# Float32 round-off between different step shapes (BLAS row counts, chunk sums): measured <= 2.2e-5 on
# logits of scale ~5 (chunk 5 vs one shot), so paths are held to 1e-4.
PATH_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def reference_model():
    assert hashlib.sha256(GGUF_PATH.read_bytes()).hexdigest() == REFERENCE["gguf_sha256"], \
        "tests/data/qwen3next_tiny.gguf is not the file the reference was computed for"
    return load_model(GGUF_PATH, NumpyBackend())[0]


def test_config_reads_the_converter_s_qwen3next_keys(reference_model):
    c, hf = reference_model.config, REFERENCE["hf_config"]
    assert c.arch == "qwen3next" and c.layer_is_recurrent == tuple(t == "linear_attention" for t in hf["layer_types"])
    s = c.delta_net
    assert (s.n_k_heads, s.n_v_heads, s.k_head_dim, s.v_head_dim, s.conv_kernel) == (
        hf["linear_num_key_heads"], hf["linear_num_value_heads"], hf["linear_key_head_dim"],
        hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"])
    assert c.head_dim == hf["head_dim"] and c.rope_dims == hf["head_dim"] // 4 and c.has_attn_gate and c.has_qk_norm
    assert (c.n_experts, c.n_experts_used, c.expert_ffn_dim, c.shared_expert_ffn_dim) == (
        hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"],
        hf["shared_expert_intermediate_size"])
    assert c.expert_weights_norm and c.n_kv_layers == 1


def _fields(**changes):
    fields = dict(GGUFFile(GGUF_PATH).fields)
    for key, value in changes.items():
        if value is None:
            del fields[f"qwen3next.{key}"]
        else:
            fields[f"qwen3next.{key}"] = value
    return fields


@pytest.mark.parametrize("key,value", [("nextn_predict_layers", 4), ("expert_gating_func", 2),
                                       ("expert_weights_norm", False), ("ssm.state_size", None),
                                       ("expert_shared_feed_forward_length", 0), ("rope.scaling.type", "yarn"),
                                       ("ssm.time_step_rank", 3)])
def test_unsupported_variants_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"qwen3next.{key}"):
        config_from_gguf(_fields(**{key: value}), vocab_size=275)


def test_mtp_layers_at_the_end_are_not_part_of_the_trunk():
    """A converter run without --no-mtp adds the MTP block as layer n (llama.cpp does not run it either)."""
    fields = _fields(block_count=5, nextn_predict_layers=1, **{"attention.recurrent_layers": [True] * 3 + [False] * 2})
    c = config_from_gguf(fields, vocab_size=275)
    assert c.n_layers == 4 and c.layer_is_recurrent == (True, True, True, False)


def test_without_the_layer_list_every_fourth_layer_is_attention():
    c = config_from_gguf(_fields(**{"attention.recurrent_layers": None}), vocab_size=275)
    assert c.layer_is_recurrent == (True, True, True, False)


def test_the_tiny_writer_writes_the_converter_s_layout(tmp_path):
    """Same tensor names, shapes and types, same qwen3next.* keys, as llama.cpp's converter wrote."""
    write_tiny_qwen3next(tmp_path / "w.gguf")
    ours, theirs = GGUFReader(str(tmp_path / "w.gguf")), GGUFReader(str(GGUF_PATH))
    layout = lambda r: {t.name: (t.shape.tolist(), t.tensor_type.name) for t in r.tensors}  # noqa: E731
    keys = lambda r: {k: f.types for k, f in r.fields.items() if k.startswith("qwen3next.")}  # noqa: E731
    assert layout(ours) == layout(theirs) and keys(ours) == keys(theirs)


@pytest.mark.parametrize("backend", [NumpyBackend, QuantizedNumpyBackend], ids=["f32", "quantized"])
@pytest.mark.parametrize("case", range(len(REFERENCE["prompts"])))
def test_logits_and_greedy_ids_match_transformers(reference_model, backend, case):
    model = reference_model if backend is NumpyBackend else load_model(GGUF_PATH, backend())[0]
    ref = REFERENCE["prompts"][case]
    assert len(ref["greedy_ids"]) >= 32
    logits, ids = prefill_and_decode(model, ref["prompt_ids"], ref["greedy_ids"], chunk=100)
    assert_close_relative(logits, np.array(ref["logits"], dtype=np.float32), f"prompt {case}")
    assert ids == ref["greedy_ids"]


def test_chunked_prefill_and_layer_splits_equal_one_shot(reference_model):
    """The 90-token prompt in one step is three 32-token chunks of the delta rule (the last one padded);
    in steps of 1, 5, 7 and 64 (across 1, 2 and 3 stages) every step starts from the state the last one left."""
    ref = REFERENCE["prompts"][1]
    whole, _ = prefill_and_decode(reference_model, ref["prompt_ids"], ref["greedy_ids"][:4], chunk=100)
    for chunk, split in ((1, ()), (5, ()), (7, (2,)), (64, (1, 3))):
        other, _ = prefill_and_decode(reference_model, ref["prompt_ids"], ref["greedy_ids"][:4], chunk, split)
        np.testing.assert_allclose(other, whole, **PATH_TOL, err_msg=f"chunk {chunk} split {split}")


def test_decode_equals_prefill(reference_model):
    """The recurrent one-token rule (decode) gives what the chunked rule gives over the same tokens."""
    ids = REFERENCE["prompts"][0]["prompt_ids"] + REFERENCE["prompts"][0]["greedy_ids"]
    prefill, _ = prefill_and_decode(reference_model, ids, [], chunk=len(ids))
    decoded, _ = prefill_and_decode(reference_model, ids[:1], ids[1:], chunk=1)
    np.testing.assert_allclose(decoded, prefill, **PATH_TOL)


def test_batched_sequences_keep_their_own_state(reference_model):
    """Continuous batching: sequences join at different steps, prefill beside decode (one vectorised
    recurrent step for the one-token rows, chunks for the others)."""
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
        np.testing.assert_allclose(np.array(batched[i]), logits[positions], **PATH_TOL)


def test_a_state_written_back_resumes_exactly(reference_model):
    """What the conversation cache relies on: the state read at position p, written into a fresh sequence
    whose K/V blocks hold the same p tokens, gives bitwise the original's next logits."""
    ids = REFERENCE["prompts"][1]["prompt_ids"]
    runner = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK)
    seq = Sequence(list(ids))
    runner.ensure_blocks(seq, len(ids))
    runner.step([(seq, 70)])
    state = runner.states.read(seq)
    assert state.shape == (3, 1, reference_model.config.delta_net.state_floats) == runner.states.shape
    expected = runner.step([(seq, len(ids) - 70)], all_logits=True)
    resumed = Sequence(list(ids), block_table=list(seq.block_table), num_computed=70)
    runner.states.write(resumed, state)
    assert resumed.state_slot != seq.state_slot
    np.testing.assert_array_equal(runner.step([(resumed, len(ids) - 70)], all_logits=True), expected)


@pytest.mark.parametrize("split", [(), (2,)])
def test_states_captured_inside_a_step_are_those_after_their_position(reference_model, split):
    """Checkpoints inside one 90-token step (three 32-token delta-rule chunks): inside the first chunk, at
    the second's end, inside the third and at the step's end; each equals the state of a run stopped there."""
    ids = REFERENCE["prompts"][1]["prompt_ids"]
    runner = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK, layer_split=split)
    seq = Sequence(list(ids))
    runner.ensure_blocks(seq, len(ids))
    runner.states.capture(seq, (7, 64, 70, 90))
    runner.step([(seq, 90)])
    captured = runner.states.take_captured(seq)
    np.testing.assert_array_equal(captured[90], runner.states.read(seq))
    for position in (7, 64, 70):
        cut = ModelRunner(reference_model, num_blocks=64, block_size=BLOCK)
        other = Sequence(list(ids))
        cut.ensure_blocks(other, len(ids))
        cut.step([(other, position)])
        np.testing.assert_allclose(captured[position], cut.states.read(other), atol=5e-5, rtol=1e-4,
                                   err_msg=f"state after {position}")
    assert runner.states.take_captured(seq) == {}


def test_the_unit_lower_triangular_inverse_is_the_inverse():
    rng = np.random.default_rng(1)
    for c in (1, 2, 8, 32):
        m = np.tril(rng.standard_normal((3, 2, c, c)), -1).astype(np.float32) * 0.3 + np.eye(c, dtype=np.float32)
        np.testing.assert_allclose(unit_lower_inverse(m) @ m, np.broadcast_to(np.eye(c), m.shape), atol=1e-5)


def test_the_delta_rule_in_chunks_equals_the_recurrent_rule():
    """engine/delta_rule.py: any chunk size (1, 7 -> 4, 64, 200 -> 128: powers of two) gives the token-by-token
    rule's outputs, final state and states after chosen rows, from a non-zero starting state."""
    rng = np.random.default_rng(0)
    heads, n, dk, dv = 3, 150, 8, 5
    q = l2_normalize(rng.standard_normal((heads, n, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    k = l2_normalize(rng.standard_normal((heads, n, dk)).astype(np.float32))
    v = rng.standard_normal((heads, n, dv)).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((heads, n))))).astype(np.float32)
    g = (-0.3 * np.exp(0.5 * rng.standard_normal((heads, n)))).astype(np.float32)
    start = rng.standard_normal((heads, dk, dv)).astype(np.float32)
    state, outs, states = start.copy(), [], {}
    for t in range(n):
        outs.append(recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], beta[None, :, t], g[None, :, t],
                                   state[None])[0])
        states[t + 1] = state.copy()
    for chunk in (1, 7, 64, 200):
        mine = start.copy()
        out, captured = chunked(q, k, v, beta, g, mine, capture_rows=(1, 7, 64, 65, 150), chunk=chunk)
        np.testing.assert_allclose(out, np.stack(outs, axis=1), atol=2e-6, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(mine, state, atol=5e-6)
        assert sorted(captured) == [1, 7, 64, 65, 150]
        for r, s in captured.items():
            np.testing.assert_allclose(s, states[r], atol=5e-6, err_msg=f"chunk {chunk}, state after {r}")
