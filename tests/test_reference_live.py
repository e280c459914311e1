"""Live comparison against HF transformers (CPU torch) loading the same GGUF files.

Skipped where transformers is not installed (CI); install it with `pip install -e '.[reference]'`.
Covers every architecture on tiny random GGUFs and the real default model on a prompt that is not in
the committed reference file.
"""
import numpy as np
import pytest

pytest.importorskip("transformers")

from engine.backends.reference.backend import NumpyBackend  # noqa: E402
from engine.batch import build_batch  # noqa: E402
from engine.kv import layout_for  # noqa: E402
from engine.model import load_model  # noqa: E402
from scripts.hf_reference import hf_greedy, hf_logits  # noqa: E402
from tests.support.tiny_gguf import ARCHS, write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.reference


def _engine_logits(model, ids):
    pool = model.backend.create_kv_pool(layout_for(model.config, 64, 16))
    return model.forward(build_batch([(ids, 0, np.arange(64))], 16, all_logits=True), pool)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_logits_match_transformers(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, seed=5)
    model, _, _ = load_model(path, NumpyBackend())
    ids = np.random.default_rng(1).integers(3, 250, size=40).tolist()  # longer than gemma3's window
    np.testing.assert_allclose(_engine_logits(model, ids), hf_logits(path, ids), atol=2e-4, rtol=1e-4)


def test_tiny_qwen3moe_logits_match_transformers(tmp_path):
    """gpt-oss is not here: transformers 5.24's GGUF loader cannot read it (scripts/make_moe_reference.py)."""
    from tests.support.tiny_moe_gguf import write_tiny_moe_gguf

    path = tmp_path / "qwen3moe.gguf"
    write_tiny_moe_gguf(path, "qwen3moe", seed=5)
    model, _, _ = load_model(path, NumpyBackend())
    ids = np.random.default_rng(2).integers(3, 250, size=40).tolist()
    np.testing.assert_allclose(_engine_logits(model, ids), hf_logits(path, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(smollm2, smollm2_path):
    text = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
    ids = smollm2.tokenizer.encode(text, add_special=False)
    np.testing.assert_allclose(_engine_logits(smollm2.model, ids), hf_logits(smollm2_path, ids), atol=2e-3, rtol=1e-3)
    expected = hf_greedy(smollm2_path, ids, 40)
    got, seq_ids = [], list(ids)
    for _ in range(40):
        got.append(int(np.argmax(_engine_logits(smollm2.model, seq_ids)[-1])))
        seq_ids.append(got[-1])
    assert got == expected
