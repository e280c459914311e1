"""MoE config from GGUF metadata: the values each arch needs, and every unsupported variant refused at
load with a message naming its key."""
from dataclasses import replace

import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.model import load_model
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf


def _config(tmp_path, arch, **overrides):
    write_tiny_moe_gguf(tmp_path / "m.gguf", arch, **overrides)
    return load_model(tmp_path / "m.gguf", NumpyBackend())[0].config


def test_qwen3moe_reads_experts_and_renormalises_its_top_k(tmp_path):
    c = _config(tmp_path, "qwen3moe", n_expert=6, n_expert_used=3, n_ff_exp=16)
    assert (c.n_experts, c.n_experts_used, c.expert_ffn_dim) == (6, 3, 16)
    assert (c.expert_gating, c.expert_weights_norm, c.expert_activation) == ("softmax", True, "silu")
    assert c.has_qk_norm and not c.has_attn_sinks and c.sliding_window == 0 and c.rope_yarn_factor == 0


def test_qwen3moe_expert_weights_norm_false_is_honoured(tmp_path):
    c = _config(tmp_path, "qwen3moe", extra_metadata={"qwen3moe.expert_weights_norm": False})
    assert c.expert_weights_norm is False


def test_gpt_oss_reads_sinks_biases_alternating_windows_and_yarn(tmp_path):
    c = _config(tmp_path, "gpt-oss", n_layer=4, sliding_window=6, yarn_factor=8.0, yarn_orig_ctx=32)
    assert c.layer_is_sliding == (True, False, True, False) and c.sliding_window == 6
    assert (c.expert_gating, c.expert_weights_norm, c.expert_activation) == ("softmax_topk", False, "swiglu_oai")
    assert c.has_attn_sinks and c.has_attn_out_bias and c.has_qkv_bias and not c.has_qk_norm
    assert (c.rope_yarn_factor, c.rope_yarn_orig_ctx, c.rope_yarn_beta_fast, c.rope_yarn_beta_slow) == (8.0, 32, 32.0, 1.0)


def test_qwen3moe_with_yarn_metadata_gets_yarn_tables_not_a_silent_plain_rope(tmp_path):
    c = _config(tmp_path, "qwen3moe", extra_metadata={"qwen3moe.rope.scaling.type": "yarn",
                                                      "qwen3moe.rope.scaling.factor": 4.0,
                                                      "qwen3moe.rope.scaling.original_context_length": 64})
    assert (c.rope_yarn_factor, c.rope_yarn_orig_ctx, c.rope_linear_scale) == (4.0, 64, 1.0)


@pytest.mark.parametrize("arch, key, value, message", [
    ("qwen3moe", "qwen3moe.expert_shared_count", 2, "qwen3moe.expert_shared_count = 2: shared experts"),
    ("qwen3moe", "qwen3moe.expert_group_count", 4, "qwen3moe.expert_group_count = 4"),
    ("qwen3moe", "qwen3moe.leading_dense_block_count", 1, "qwen3moe.leading_dense_block_count = 1"),
    ("qwen3moe", "qwen3moe.expert_gating_func", 2, "qwen3moe.expert_gating_func = 2 is not supported"),
    ("gpt-oss", "gpt-oss.expert_gating_func", 1, "gpt-oss.expert_gating_func = 1 is not supported"),
    ("gpt-oss", "gpt-oss.rope.scaling.yarn_attn_factor", 0.5, "gpt-oss.rope.scaling.yarn_attn_factor"),
    ("qwen3moe", "qwen3moe.rope.scaling.type", "longrope", "qwen3moe.rope.scaling.type = 'longrope'"),
])
def test_an_unsupported_variant_fails_at_load_naming_the_key(tmp_path, arch, key, value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        _config(tmp_path, arch, extra_metadata={key: value})


def test_more_experts_used_than_there_are_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_used_count = 9 must be in 1\.\.qwen3moe\.expert_count \(8\)"):
        _config(tmp_path, "qwen3moe", n_expert_used=9)


def test_a_backend_without_moe_ops_refuses_the_model_and_says_what_to_use(tmp_path):
    class NoMoe(NumpyBackend):
        name = "cuda"
        capabilities = replace(NumpyBackend.capabilities, moe=False)

    write_tiny_moe_gguf(tmp_path / "m.gguf", "gpt-oss")
    with pytest.raises(ValueError, match="gpt-oss is a mixture-of-experts model and the cuda backend has no "
                                         "route_experts/expert_ffn yet; run it with --backend numpy"):
        load_model(tmp_path / "m.gguf", NoMoe())
