"""MoE models on the CUDA backend, on the real kernel sources run on the CPU (tests/support/fake_cuda_emulated.py) and,
marked `cuda`, on a GPU where there is one:
the device MoE path (moe_route_f32 -> moe_plan -> moe_matvec/moe_gemm gate/up -> activation -> down ->
moe_combine_f32, engine/backends/cuda/moe.py) gives the numpy backend's tokens and logits, for qwen3moe and
for gpt-oss (attention sinks, biased experts, MXFP4)."""
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.model import load_model
from tests.support.cuda_backend_checks import GEMM, assert_close, greedy_and_logits
from tests.support.cuda_fixture import cuda_backend
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf

MOE_KERNELS = {"moe_route_f32", "moe_plan", "moe_combine_f32"}


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=pytest.mark.cuda)])
def emu(request, monkeypatch):
    """A CudaBackend (graphs off, activations poisoned with NaN) on the emulated kernels or on device 0.
    (tests/test_cuda_backend.py's "fake" driver has no numpy twins of the MoE kernels.)"""
    yield from cuda_backend(request.param, monkeypatch, request)


def _launched(backend) -> set[str] | None:
    return None if backend.test_driver is None else set(backend.test_driver.launches)


@pytest.mark.parametrize("expert_quant", ["F32", "Q8_0"])
def test_qwen3moe_greedy_tokens_on_the_device_moe_path_equal_numpy(emu, tmp_path, expert_quant):
    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, expert_quant=expert_quant,
                        router_scale=0.3)
    numpy_model = load_model(tmp_path / "m.gguf", NumpyBackend())[0]
    expected, expected_first = greedy_and_logits(numpy_model, range(3, 15), steps=6)
    model = load_model(tmp_path / "m.gguf", emu)[0]
    assert model.weights.layers[0].moe.device is not None and not model.weights.layers[0].moe.gate_up
    tokens, first = greedy_and_logits(model, range(3, 15), steps=6)
    assert_close(first, expected_first, GEMM)
    assert tokens == expected
    launched = _launched(emu)
    assert launched is None or MOE_KERNELS | {f"moe_matvec_{expert_quant.lower()}", f"moe_gemm_{expert_quant.lower()}",
                                              "gated_silu_f32"} <= launched  # gemm: the 12-token prefill


@pytest.mark.parametrize("expert_quant", ["F32", "MXFP4"])
def test_gpt_oss_greedy_tokens_on_cuda_equal_numpy(emu, tmp_path, expert_quant):
    """Sinks (split attention + attention_combine_sinks_f32), alternating windows, YaRN tables, Q/K/V/O and
    router biases, biased experts with the clamped SwiGLU, MXFP4 expert blocks."""
    write_tiny_moe_gguf(tmp_path / "m.gguf", "gpt-oss", seed=2, n_layer=2, sliding_window=5, weight_scale=0.1,
                        router_scale=0.3, expert_quant=expert_quant)
    numpy_model = load_model(tmp_path / "m.gguf", NumpyBackend())[0]
    expected, expected_first = greedy_and_logits(numpy_model, range(3, 15), steps=6)
    tokens, first = greedy_and_logits(load_model(tmp_path / "m.gguf", emu)[0], range(3, 15), steps=6)
    assert_close(first, expected_first, GEMM)
    assert tokens == expected
    launched = _launched(emu)
    assert launched is None or {"attention_combine_sinks_f32", "gated_swiglu_oai_f32",
                                f"moe_matvec_{expert_quant.lower()}"} <= launched


def test_a_fused_gate_up_tensor_is_split_for_the_device(emu, tmp_path):
    write_tiny_moe_gguf(tmp_path / "m.gguf", "gpt-oss", seed=2, n_layer=2, weight_scale=0.1, router_scale=0.3,
                        fused_gate_up=True, expert_quant="Q8_0")
    expected, _ = greedy_and_logits(load_model(tmp_path / "m.gguf", NumpyBackend())[0], range(3, 15), steps=4)
    tokens, _ = greedy_and_logits(load_model(tmp_path / "m.gguf", emu)[0], range(3, 15), steps=4)
    assert tokens == expected


def test_a_backend_without_sinks_refuses_gpt_oss(tmp_path):
    from engine.backends.capabilities import Capabilities
    from engine.backends.placement import require_runs

    class NoSinks:
        name = "other"
        capabilities = Capabilities(moe=True)

        def route_experts(self): ...

        def expert_ffn(self): ...

        def attention(self, q, pool, layer, batch, scale, window): ...

    write_tiny_moe_gguf(tmp_path / "m.gguf", "gpt-oss")
    config = load_model(tmp_path / "m.gguf", NumpyBackend())[0].config
    with pytest.raises(ValueError, match="gpt-oss needs attention sinks, which the other backend does not"):
        require_runs(NoSinks(), config.arch)


def test_qwen3moe_decode_replays_a_cuda_graph_with_the_same_tokens(emulator_dir, monkeypatch, tmp_path):
    """The MoE path has no host round trip (moe_plan on the device, fixed grids), so decode steps capture."""
    from tests.support import fake_cuda_emulated

    driver = fake_cuda_emulated.install(monkeypatch, emulator_dir)
    from engine.backends.cuda.backend import CudaBackend

    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, router_scale=0.3)
    expected, _ = greedy_and_logits(load_model(tmp_path / "m.gguf", NumpyBackend())[0], range(3, 15), steps=6)
    backend = CudaBackend(graphs=True)
    try:
        tokens, _ = greedy_and_logits(load_model(tmp_path / "m.gguf", backend)[0], range(3, 15), steps=6)
        assert tokens == expected
        assert backend.graphs is not None and backend.graphs.replays > 0
    finally:
        backend.close()
    assert "moe_plan" in driver.launches
