"""Gemma 3 270M (Q4_K_M) against the committed transformers reference (tests/data/gemma3_reference.json).

Regenerate the file with `python scripts/make_reference.py --model gemma3-270m`. Besides what the SmolLM2
reference covers, this one checks the gemma3 specifics: BOS added by the tokenizer, embedding scale, the
(1 + w) RMS norms and post norms, GELU gating, the two RoPE bases and, above all, the 5 local : 1 global
layer pattern with a 512-token sliding window: the `long_lighthouses` prompt has 724 tokens, so its greedy
steps and its last prompt positions only match if the local layers see exactly the last 512 positions.

Two prefill schedules are used so that window masking is tested both across steps and inside one step:
the greedy test prefills in chunks of 128 (chunk borders at 128, 256, ..., crossing the window border
between steps), the prompt-position test splits the prompt right after each reference position (for the
long prompt one 360-token chunk whose queries need keys both inside and outside their window).
"""
import json
from pathlib import Path

import pytest


from engine.sequence import ModelRunner, Sequence
from tests.support.reference_helpers import assert_top5, greedy_with_logits

REFERENCE = json.loads((Path(__file__).parent / "data" / "gemma3_reference.json").read_text())
PROMPTS = REFERENCE["prompts"]
pytestmark = pytest.mark.slow


def test_reference_matches_the_fetched_file(gemma3_path):
    from engine.model_store import KNOWN_MODELS

    assert KNOWN_MODELS["gemma3-270m"].sha256 == REFERENCE["gguf_sha256"]
    assert Path(gemma3_path).name == REFERENCE["model"]


def test_reference_exercises_the_sliding_window(gemma3):
    config = gemma3.model.config
    assert config.sliding_window == 512
    assert any(config.layer_is_sliding) and not all(config.layer_is_sliding)
    assert max(len(p["prompt_ids"]) for p in PROMPTS) > config.sliding_window
    assert max(int(pos) for p in PROMPTS for pos in p["prompt_top5"]) > config.sliding_window


@pytest.mark.parametrize("case", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_tokenizer_matches_reference_ids(gemma3, case):
    ids = gemma3.tokenizer.encode(case["text"])  # BOS added, like transformers' add_special_tokens=True
    assert ids[0] == REFERENCE["bos_id"] == gemma3.tokenizer.bos_id
    assert ids == case["prompt_ids"]


@pytest.mark.parametrize("case", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_greedy_ids_and_logits_match_reference(gemma3, case):
    ids, step_logits = greedy_with_logits(gemma3.model, case["prompt_ids"], len(case["greedy_ids"]), chunk=128)
    for k, (row, top5) in enumerate(zip(step_logits, case["step_top5"])):
        assert_top5(row, top5, f"{case['name']}: logits predicting greedy token {k}")
    assert ids == case["greedy_ids"]


@pytest.mark.parametrize("case", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_prompt_position_logits_match_reference(gemma3, case):
    """Prefill split right after each reference position, so each one is the last row of a step."""
    runner = ModelRunner(gemma3.model, num_blocks=64, block_size=16)
    seq = Sequence(list(case["prompt_ids"]))
    assert runner.ensure_blocks(seq, len(seq.token_ids))
    for position in sorted(int(p) for p in case["prompt_top5"]):
        logits = runner.step([(seq, position + 1 - seq.num_computed)])
        assert_top5(logits[-1], case["prompt_top5"][str(position)], f"{case['name']}: prompt position {position}")
