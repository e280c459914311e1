"""The real models' greedy decoding through the fused decode step against the unfused path (the reference).

Both load the same quantised weights. With float32 activations (`quantized-f32act`) they differ only in
summation order inside products and attention, so greedy ids must be identical for 48 tokens on every
reference prompt and every logit within LOGIT_BOUND. The default int16 activations (cpu/int8_matvec.py)
add their rounding: ids still identical, logits within INT16_LOGIT_BOUND. int8 activations (llama.cpp's
rule) are not held to the references: they moved logits by up to 0.39 and changed greedy ids after 14 and 24
tokens on 2 of the 7 transformers prompts (SmolLM2; docs/BENCHMARKS.md). The transformers references
(test_reference_smollm2.py, test_reference_gemma3.py) run the default (fused, int16).
"""
import json
from pathlib import Path

import numpy as np
import pytest

from engine.loader import open_model
from tests.support.reference_helpers import N_TOKENS, PROMPTS_IN_CI, greedy_with_logits

pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data"
# Largest |logit(fused) - logit(unfused)| over every step of the CI prompts: measured 4.4e-5 on SmolLM2 and
# 4.4e-5 on gemma3 (logits of magnitude 10-40, 2 prompts x 48 tokens); 20x margin for other CPUs' SIMD widths.
LOGIT_BOUND = 1e-3
# The same with int16 activations: measured 4.4e-3 (SmolLM2) and 3.8e-3 (gemma3), the activation rounding
# (at most half of 1/32767 of each block's largest value) through every layer; 4.5x margin.
INT16_LOGIT_BOUND = 2e-2


def _compare(path, reference_file, chunk, activations, bound) -> None:
    prompts = json.loads((DATA / reference_file).read_text())["prompts"][:PROMPTS_IN_CI]
    model = open_model(str(path), max_positions=2048).model
    model.backend.activations = activations
    runs = {}
    for fused in (True, False):
        model.backend.fused_decode = fused
        runs[fused] = [greedy_with_logits(model, p["prompt_ids"], N_TOKENS, chunk=chunk) for p in prompts]
    worst = 0.0
    for p, (ids_f, logits_f), (ids_u, logits_u) in zip(prompts, runs[True], runs[False]):
        assert ids_f == ids_u, f"{p['name']}: greedy ids differ"
        worst = max(worst, float(np.max(np.abs(np.array(logits_f) - np.array(logits_u)))))
    print(f"{path.name}: largest |logit difference| fused ({activations}) vs unfused {worst:.2e}")  # with -s
    assert worst <= bound, worst


@pytest.mark.parametrize("activations, bound", [("f32", LOGIT_BOUND), ("int16", INT16_LOGIT_BOUND)])
def test_smollm2_fused_decode_keeps_greedy_ids_and_logits(smollm2_path, activations, bound):
    _compare(smollm2_path, "smollm2_reference.json", 64, activations, bound)


@pytest.mark.parametrize("activations, bound", [("f32", LOGIT_BOUND), ("int16", INT16_LOGIT_BOUND)])
def test_gemma3_fused_decode_keeps_greedy_ids_and_logits(gemma3_path, activations, bound):
    _compare(gemma3_path, "gemma3_reference.json", 128, activations, bound)
