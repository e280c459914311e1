"""The real models' greedy decoding through the fused decode step against the unfused path (the reference).

Both load the same quantised weights; they differ only in summation order inside products and attention,
so greedy ids must be identical for 48 tokens on every reference prompt and every logit within LOGIT_BOUND.
The transformers references (test_reference_smollm2.py, test_reference_gemma3.py) run fused by default.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from engine.loader import open_model
from tests.reference_helpers import greedy_with_logits
from tests.test_cpu_weights_reference import N_TOKENS, PROMPTS_IN_CI

pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data"
# Largest |logit(fused) - logit(unfused)| over every step of the CI prompts: measured 4.4e-5 on SmolLM2 and
# 4.4e-5 on gemma3 (logits of magnitude 10-40, 2 prompts x 48 tokens); 20x margin for other CPUs' SIMD widths.
LOGIT_BOUND = 1e-3


def _compare(path, reference_file, chunk) -> None:
    prompts = json.loads((DATA / reference_file).read_text())["prompts"][:PROMPTS_IN_CI]
    model = open_model(str(path), max_positions=2048).model
    runs = {}
    for fused in (True, False):
        model.backend.fused_decode = fused
        runs[fused] = [greedy_with_logits(model, p["prompt_ids"], N_TOKENS, chunk=chunk) for p in prompts]
    model.backend.fused_decode = True
    worst = 0.0
    for p, (ids_f, logits_f), (ids_u, logits_u) in zip(prompts, runs[True], runs[False]):
        assert ids_f == ids_u, f"{p['name']}: greedy ids differ"
        worst = max(worst, float(np.max(np.abs(np.array(logits_f) - np.array(logits_u)))))
    print(f"{path.name}: largest |logit difference| fused vs unfused {worst:.2e}")  # shown with -s
    assert worst <= LOGIT_BOUND, worst


def test_smollm2_fused_decode_keeps_greedy_ids_and_logits(smollm2_path):
    _compare(smollm2_path, "smollm2_reference.json", chunk=64)


def test_gemma3_fused_decode_keeps_greedy_ids_and_logits(gemma3_path):
    _compare(gemma3_path, "gemma3_reference.json", chunk=128)
