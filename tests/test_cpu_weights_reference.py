"""The real models on `--cpu-weights quantized-f32act` against `--cpu-weights f32` (the float32 reference).

The two differ only in the order the float32 products are summed (kernels on raw blocks, tiles through
the scratch buffer, BLAS), so greedy ids must be identical for 48 tokens on every reference prompt and
every logit within LOGIT_BOUND (docs/BENCHMARKS.md gives the measured maximum). The transformers
references (test_reference_smollm2.py, test_reference_gemma3.py) run on the quantised default, whose
decode steps also round the activations to int16 (checked against this path in test_cpu_fused_reference.py).
"""
import json
from pathlib import Path

import numpy as np
import pytest

from engine.loader import open_model
from tests.support.reference_helpers import N_TOKENS, PROMPTS_IN_CI, greedy_with_logits

pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data"
# Largest |logit(quantized) - logit(f32)| over every step of every prompt: measured 4.2e-5 on SmolLM2 and
# 9.9e-5 on gemma3 (logits of magnitude 10-40); a 10x margin for other CPUs' SIMD widths.
LOGIT_BOUND = 1e-3


def _compare(path, reference_file, chunk) -> None:
    prompts = json.loads((DATA / reference_file).read_text())["prompts"][:PROMPTS_IN_CI]
    runs = {}
    for mode in ("quantized-f32act", "f32"):
        model = open_model(str(path), cpu_weights=mode, max_positions=2048).model
        runs[mode] = [greedy_with_logits(model, p["prompt_ids"], N_TOKENS, chunk=chunk) for p in prompts]
        del model  # one float32 copy of the weights in memory at a time
    worst = 0.0
    for p, (ids_q, logits_q), (ids_f, logits_f) in zip(prompts, runs["quantized-f32act"], runs["f32"]):
        assert ids_q == ids_f, f"{p['name']}: greedy ids differ"
        worst = max(worst, float(np.max(np.abs(np.array(logits_q) - np.array(logits_f)))))
    print(f"{path.name}: largest |logit difference| {worst:.2e}")  # shown with -s; docs/BENCHMARKS.md
    assert worst <= LOGIT_BOUND, worst


def test_smollm2_quantized_weights_keep_greedy_ids_and_logits(smollm2_path):
    _compare(smollm2_path, "smollm2_reference.json", chunk=64)


def test_gemma3_quantized_weights_keep_greedy_ids_and_logits(gemma3_path):
    _compare(gemma3_path, "gemma3_reference.json", chunk=128)
