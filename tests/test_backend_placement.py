"""Which architecture runs on which backend (engine/backends/placement.py), from the backends' declared
capabilities: the loader's choice before a backend exists and load_model's check of the one it was given
agree, and neither needs a GPU."""
import logging

import pytest

from engine.backends.capabilities import ATTENTION, SHORT_CONV, Capabilities
from engine.backends.placement import backend_for_arch, capabilities_of, refusal, require_runs


def test_cuda_runs_lfm2_when_asked_and_auto_keeps_it_on_numpy_until_it_has_run_on_a_gpu(caplog):
    assert refusal("lfm2", "cuda", capabilities_of("cuda")) is None
    assert backend_for_arch("lfm2", "cuda", "lfm2.gguf") == "cuda"
    with caplog.at_level(logging.INFO, logger="strata.loader"):
        assert backend_for_arch("lfm2", "auto", "lfm2.gguf") == "numpy"
    assert "lfm2's cuda path has run on the kernel emulator but not on a GPU yet" in caplog.text


def test_qwen3next_is_refused_on_cuda_by_name_and_auto_takes_numpy():
    with pytest.raises(ValueError, match=r"--backend cuda: q\.gguf: qwen3next is a hybrid model whose delta_net "
                                         r"layers have no kernels on the cuda backend yet; run it with --backend numpy"):
        backend_for_arch("qwen3next", "cuda", "q.gguf")
    assert backend_for_arch("qwen3next", "auto", "q.gguf") == "numpy"
    assert backend_for_arch("qwen3next", "numpy", "q.gguf") == "numpy"


def test_moe_archs_run_on_cuda_when_asked_and_auto_keeps_them_on_numpy():
    for arch in ("qwen3moe", "gpt-oss"):
        assert backend_for_arch(arch, "cuda", "m.gguf") == "cuda"
        assert backend_for_arch(arch, "auto", "m.gguf") == "numpy"


def test_a_dense_transformer_leaves_auto_to_the_device_probe():
    assert backend_for_arch("llama", "auto", "m.gguf") == "auto"
    assert backend_for_arch("llama", "cuda", "m.gguf") == "cuda"


def test_the_defaults_are_the_least_a_backend_offers_and_each_missing_capability_is_named():
    class Bare:
        name, capabilities = "bare", Capabilities()

    assert Capabilities().layer_kinds == frozenset({ATTENTION}) and Capabilities().kv_types == ("f32",)
    require_runs(Bare(), "llama")
    for arch, words in (("lfm2", "short_conv layers"), ("qwen3moe", "route_experts/expert_ffn"),
                        ("gpt-oss", "route_experts/expert_ffn")):
        with pytest.raises(ValueError, match=words):
            require_runs(Bare(), arch)
    Bare.capabilities = Capabilities(moe=True, layer_kinds=frozenset({ATTENTION, SHORT_CONV}))
    require_runs(Bare(), "lfm2")
    with pytest.raises(ValueError, match="gpt-oss needs attention sinks, which the bare backend does not compute"):
        require_runs(Bare(), "gpt-oss")
