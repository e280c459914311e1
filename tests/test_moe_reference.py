"""Tiny qwen3moe and gpt-oss GGUFs against transformers (tests/data/moe_reference.json, no torch needed).

scripts/make_moe_reference.py wrote the JSON from transformers (see its docstring for how each case was
loaded: qwen3moe through transformers' GGUF loader, gpt-oss through transformers' GptOss model code with
the weights placed by the script, because that loader cannot read gpt-oss files in transformers 5.24).
This test rewrites each GGUF from its seed, checks it is byte-identical to the one the reference saw, and
requires greedy ids equal for 40 tokens and logits within 1e-3 relative, on both numpy weight modes.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine.backends.cpu.backend import QuantizedNumpyBackend
from engine.backends.reference.backend import NumpyBackend
from engine.model import load_model
from engine.sequence import ModelRunner, Sequence
from tests.support.reference_helpers import assert_top5, greedy_with_logits
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf

REFERENCE = json.loads((Path(__file__).parent / "data" / "moe_reference.json").read_text())
CASES = REFERENCE["cases"]
BACKENDS = {"f32": NumpyBackend, "quantized": QuantizedNumpyBackend}


@pytest.fixture(scope="module", params=[(c["name"], b) for c in CASES for b in BACKENDS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request, tmp_path_factory):
    name, backend = request.param
    case = next(c for c in CASES if c["name"] == name)
    path = tmp_path_factory.mktemp("moe_ref") / f"{name}.gguf"
    write_tiny_moe_gguf(path, case["arch"], seed=case["seed"], **case["overrides"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == case["gguf_sha256"], "the tiny writer changed"
    model, _, _ = load_model(path, BACKENDS[backend]())
    return case, model


def test_greedy_ids_and_step_logits_match_transformers(loaded):
    case, model = loaded
    for prompt in case["prompts"]:
        ids, steps = greedy_with_logits(model, prompt["prompt_ids"], len(prompt["greedy_ids"]), chunk=16, block_size=4)
        assert ids == prompt["greedy_ids"]
        for k, (row, top5) in enumerate(zip(steps, prompt["step_top5"])):
            assert_top5(row, top5, f"{case['name']} greedy step {k}")


def test_prompt_logits_match_transformers(loaded):
    case, model = loaded
    for prompt in case["prompts"]:
        runner = ModelRunner(model, num_blocks=16, block_size=4)
        seq = Sequence(list(prompt["prompt_ids"]))
        assert runner.ensure_blocks(seq, len(seq.token_ids))
        logits = runner.step([(seq, len(seq.token_ids))], all_logits=True)
        for position, top5 in enumerate(prompt["prompt_top5"]):
            assert_top5(logits[position], top5, f"{case['name']} prompt position {position}")
        for position, row in prompt["prompt_rows"].items():
            np.testing.assert_allclose(logits[int(position)], row, rtol=1e-3, atol=1e-3)
