"""The real default model against the committed transformers reference (tests/data/smollm2_reference.json).

Regenerate the file with scripts/make_reference.py. These tests fail if a RoPE layout, a norm, the Q/K
permutation, the tokenizer or the paged decode path is wrong: greedy ids must match exactly and the
reference's top-5 logits within 1e-3 relative.
"""
import json
from pathlib import Path

import pytest


from engine.sequence import ModelRunner, Sequence
from tests.support.reference_helpers import assert_top5, greedy_with_logits

REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text())
PROMPTS = REFERENCE["prompts"]
pytestmark = pytest.mark.slow


def test_reference_matches_the_fetched_file(smollm2_path):
    from engine.model_store import KNOWN_MODELS

    assert KNOWN_MODELS["smollm2"].sha256 == REFERENCE["gguf_sha256"]


@pytest.mark.parametrize("case", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_tokenizer_matches_reference_ids(smollm2, case):
    assert smollm2.tokenizer.encode(case["text"], add_special=False, parse_special=True) == case["prompt_ids"]


@pytest.mark.parametrize("case", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_greedy_ids_and_logits_match_reference(smollm2, case):
    ids, step_logits = greedy_with_logits(smollm2.model, case["prompt_ids"], len(case["greedy_ids"]))
    assert ids == case["greedy_ids"]
    for row, top5 in zip(step_logits, case["step_top5"]):
        assert_top5(row, top5)


@pytest.mark.parametrize("case", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_prompt_position_logits_match_reference(smollm2, case):
    runner = ModelRunner(smollm2.model, num_blocks=64, block_size=16)
    seq = Sequence(list(case["prompt_ids"]))
    runner.ensure_blocks(seq, len(seq.token_ids))
    logits = runner.step([(seq, len(seq.token_ids))], all_logits=True)
    for position, top5 in case["prompt_top5"].items():
        assert_top5(logits[int(position)], top5)
