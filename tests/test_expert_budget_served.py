"""The expert cache's budget as `strata serve` wires it (api/serve.build_state -> scheduler/engine_build.py's
create_engine -> connect_expert_budget) on the emulated driver: with an elastic pool the slots are mapped beside
it in its MAX, counted once and shown (the start-up line, /cache tiers, /metrics); slots that do not fit beside
the pool's start fail at start."""
import pytest

from tests.support.cuda_backend_checks import PAGE
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf


def _served_state(tmp_path, monkeypatch, emulator_dir, expert_cache_mib, **moe):  # noqa: F811

    from api.config import ServerConfig
    from api.serve import build_state
    from engine.backends.cuda.backend import CudaBackend
    from engine.loader import open_model
    from tests.support import fake_cuda_emulated

    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, expert_quant="Q8_0", **moe)
    fake_cuda_emulated.install(monkeypatch, emulator_dir).vmm_granularity = PAGE
    backend = CudaBackend(graphs=False)
    loaded = open_model(str(tmp_path / "m.gguf"), backend=backend, fetch=False, expert_cache_mib=expert_cache_mib)
    config = ServerConfig(port=0).replace(batch=1, ctx_size=64, conversation_cache_mib=0, kv_cache_mib="0:1",
                     expert_cache_mib=expert_cache_mib, backend="cuda")
    return backend, lambda: build_state(config, loaded)


def test_served_with_an_elastic_pool_the_slots_are_granted_beside_it_and_shown(tmp_path, monkeypatch, emulator_dir,  # noqa: F811
                                                                              caplog):
    from scheduler.engine_views import tier_budgets

    backend, build = _served_state(tmp_path, monkeypatch, emulator_dir, "auto")
    with caplog.at_level("INFO", logger="strata.expert_cache"):
        state = build()
    cache, engine = backend.expert_cache, state.engine
    holder = engine.memory.holders["moe_experts"]
    assert cache.memory.kind == "vmm" and cache.num_slots == cache.total_experts == 16  # auto: all fit beside
    assert holder.held_bytes == cache.device_bytes == cache.memory.bytes_for(16) == 27 * PAGE
    admission = engine.cache.admission
    assert admission.device_budget_bytes == 2**20  # the pool's MAX, shared: counted once
    assert admission.device_ceiling_blocks == (2**20 - 27 * PAGE) // admission.block_bytes
    assert "held_by_moe_experts_mib" in tier_budgets(engine)["device"]
    assert any("device budget 1.0 MiB" in r.getMessage() and "moe_experts" in r.getMessage() for r in caplog.records)
    text = state.metrics.render().decode()
    assert f'strata_expert_cache_bytes{{where="device_held"}} {float(27 * PAGE)}' in text
    assert 'strata_expert_cache_resizes_total{direction="shrink"} 0.0' in text  # the start-up size is no resize
    assert 'strata_expert_cache_resizes_total{direction="grow"} 0.0' in text
    backend.close()


def test_slots_that_do_not_fit_beside_the_pools_start_fail_at_start_naming_the_flags(tmp_path, monkeypatch,
                                                                                     emulator_dir):  # noqa: F811
    backend, build = _served_state(tmp_path, monkeypatch, emulator_dir, "2", n_expert=128)  # 256 slots, 1.7 MiB
    with pytest.raises(ValueError, match="raise --kv-cache-mib MAX or lower --expert-cache-mib"):
        build()
    backend.close()
