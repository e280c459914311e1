"""The CUDA expert cache (engine/backends/cuda/expert_cache/cache.py, --expert-cache-mib) on the emulated driver with the
real kernel sources: greedy tokens with fewer device slots than experts (down to one: every layer then runs in
rounds) equal all experts resident and numpy's; slots hold exactly the host arena's bytes of their expert; hit and
miss counts exact on a scripted routing; the pinned arena holds the GGUF's expert bytes; a resize between steps."""
import numpy as np
import pytest
from gguf import GGUFReader

from engine.backends.cuda.expert_cache.cache import ROLES
from engine.backends.cuda.expert_cache.setup import configure_expert_cache, parse_expert_cache_mib
from engine.backends.reference.backend import NumpyBackend
from engine.model import load_model
from tests.support.cuda_backend_checks import greedy_and_logits
from tests.support.device_params import GPU
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf

PROMPT = range(3, 15)  # 12 tokens: a moe_gemm prefill, then moe_matvec decode steps


@pytest.fixture(params=["emulated", GPU])
def make_backend(request, monkeypatch):
    """Factory of CudaBackends (graphs on, activations poisoned with NaN) on the emulated kernels or on device 0;
    with cache_slots, an expert cache that starts with that many slots."""
    if request.param == "gpu":
        from engine.backends.cuda.device import probe

        available, reason = probe()
        if not available:
            pytest.skip(f"no CUDA device: {reason}")
    else:
        from tests.support import fake_cuda_emulated

        fake_cuda_emulated.install(monkeypatch, request.getfixturevalue("emulator_dir"))
    from engine.backends.cuda.backend import CudaBackend

    made = []

    def make(cache_slots=None):
        backend = CudaBackend(graphs=True)
        backend.poison = True
        cache = None
        if cache_slots is not None:
            cache = configure_expert_cache(backend, "auto")
            cache.request_resize(cache_slots)  # before the first step: the slot count it starts with
        made.append(backend)
        return backend, cache

    yield make
    for backend in made:
        backend.close()


def _slot_bytes_match_the_arena(backend, cache):
    """Every resident expert's slot holds its gate, up and down bytes from the host arena."""
    for layer_index, expert in cache.slots.resident():
        layer = cache.layers[layer_index]
        for i, role in enumerate(ROLES):
            offset, nbytes = layer.parts[role]
            got = np.empty(nbytes, np.uint8)
            backend.device.dtoh(got.ctypes.data, int(layer.table[i, expert]), nbytes, backend.stream)
            want = layer.host.array[offset + expert * nbytes : offset + (expert + 1) * nbytes]
            assert (got == want).all(), f"slot of layer {layer_index} expert {expert} {role} differs"


@pytest.mark.parametrize("arch, quant, slots", [("qwen3moe", "Q8_0", 3), ("qwen3moe", "F32", 1),
                                                ("gpt-oss", "MXFP4", 5)])
def test_tokens_with_fewer_slots_than_experts_equal_all_resident_and_numpy(make_backend, tmp_path, arch, quant,
                                                                           slots):
    extra = dict(sliding_window=5, weight_scale=0.1) if arch == "gpt-oss" else {}
    write_tiny_moe_gguf(tmp_path / "m.gguf", arch, seed=2, n_layer=2, router_scale=0.3, expert_quant=quant, **extra)
    expected, _ = greedy_and_logits(load_model(tmp_path / "m.gguf", NumpyBackend())[0], PROMPT, steps=6)
    resident, _ = make_backend()
    assert greedy_and_logits(load_model(tmp_path / "m.gguf", resident)[0], PROMPT, steps=6)[0] == expected
    backend, cache = make_backend(slots)
    model = load_model(tmp_path / "m.gguf", backend)[0]
    assert backend.graphs is None  # routing is read back each layer: no decode graphs
    assert model.weights.layers[0].moe.device.gate.weight is None  # the experts live in the host arena
    tokens, _ = greedy_and_logits(model, PROMPT, steps=6)
    assert tokens == expected
    s = cache.stats()
    assert s["expert_cache_slots"] == slots < cache.total_experts == 16
    assert s["expert_cache_loads"] == s["expert_cache_misses"] > 0
    assert (s["expert_cache_hits"] > 0) == (slots > 1)  # one slot, two layers: every use is a load
    expert_bytes = sum(cache.layers[0].parts[role][1] for role in ROLES)
    assert s["expert_cache_loaded_bytes"] == s["expert_cache_loads"] * expert_bytes
    cache.slots.check_integrity()
    _slot_bytes_match_the_arena(backend, cache)


def test_the_pinned_arena_holds_the_gguf_expert_tensors_bytes(make_backend, tmp_path):
    write_tiny_moe_gguf(tmp_path / "m.gguf", "gpt-oss", seed=1, n_layer=2, expert_quant="MXFP4")
    backend, cache = make_backend(2)
    load_model(tmp_path / "m.gguf", backend)
    tensors = GGUFReader(tmp_path / "m.gguf").tensors
    want = sum(int(t.n_bytes) for t in tensors if "_exps.weight" in t.name)
    assert cache.host_arena_bytes == want and len(cache.layers) == 2
    first = cache.layers[0]
    gate = next(t for t in tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert bytes(first.host.array[: int(gate.n_bytes)]) == bytes(np.asarray(gate.data).view(np.uint8).reshape(-1))


def test_hits_misses_and_tables_on_a_scripted_routing(make_backend, tmp_path):
    """begin/load on the device with routings given by hand: exact counts per layer, loads and bytes, and each
    round's slot table points at its experts' bytes."""
    from engine.backends.cuda.expert_cache.cache import ExpertCache

    backend, _ = make_backend()
    rng = np.random.default_rng(0)
    cache = ExpertCache(backend.device, "auto")
    n_experts, sizes = 4, {"gate": 96, "up": 96, "down": 80}  # bytes per expert
    layers = [cache.register({r: rng.integers(0, 255, (n_experts, sizes[r]), dtype=np.uint8) for r in ROLES},
                             n_experts) for _ in range(2)]
    cache.request_resize(3)
    script = [(0, [[0, 1]]), (1, [[2, 3]]), (0, [[1, 0], [1, 2]]), (1, [[3, 0]])]
    for layer, ids in script:
        ids = backend.upload_activation(np.array(ids, dtype=np.int32))
        rounds = cache.begin(backend, layers[layer], ids, group_rows=8)
        for r in rounds:
            tables, keep = cache.load(backend, layers[layer], r)
            for i, role in enumerate(ROLES):
                table = np.empty(n_experts, np.uint64)
                backend.device.dtoh(table.ctypes.data, tables[role], 8 * n_experts, backend.stream)
                offset, nbytes = layers[layer].parts[role]
                for expert in r.experts:
                    got = np.empty(nbytes, np.uint8)
                    backend.device.dtoh(got.ctypes.data, int(table[expert]), nbytes, backend.stream)
                    want = layers[layer].host.array[offset + expert * nbytes : offset + (expert + 1) * nbytes]
                    assert (got == want).all()
        cache.finish(backend, rounds)
    # L0 {0,1}: 2 misses; L1 {2,3}: 2 misses (evicts (0,0)); L0 {0,1,2}: 3 > 3 slots? no: 3 slots, one round:
    # 1 hit, 0 and 2 miss (evict (1,2), (1,3)); L1 {0,3}: 2 misses (evict (0,1), (0,0))
    assert cache.stats()["expert_cache_layers"] == {0: (1, 4), 1: (0, 4)}
    assert cache.loads == 8 and cache.loaded_bytes == 8 * sum(sizes.values())
    assert cache.slots.resident() == [(0, 2), (1, 0), (1, 3)]


def test_a_resize_asked_mid_step_applies_at_the_next_step_and_tokens_stay_equal(make_backend, tmp_path):
    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=3, n_layer=2, router_scale=0.3)
    expected, _ = greedy_and_logits(load_model(tmp_path / "m.gguf", NumpyBackend())[0], PROMPT, steps=6)
    backend, cache = make_backend(6)
    model = load_model(tmp_path / "m.gguf", backend)[0]
    seen = []  # (step, slots) at each layer's begin
    steps = [0]
    start, begin = cache.at_step_start, cache.begin

    def at_step_start():
        steps[0] += 1
        start()

    def layer_begin(*args, **kwargs):
        rounds = begin(*args, **kwargs)
        seen.append((steps[0], cache.num_slots))
        if steps[0] == 2 and len(seen) == 3:  # the second step's first layer: requests arrive mid-step
            cache.request_shrink(5)
            cache.request_grow(1)  # relative to the pending 1: 2 slots
        return rounds

    cache.at_step_start, cache.begin = at_step_start, layer_begin
    assert greedy_and_logits(model, PROMPT, steps=6)[0] == expected
    assert seen[:6] == [(1, 6), (1, 6), (2, 6), (2, 6), (3, 2), (3, 2)]  # the step it arrived in kept 6 slots
    assert cache.num_slots == 2 and len(cache.slots.resident()) == 2
    cache.slots.check_integrity()
    _slot_bytes_match_the_arena(backend, cache)


def test_the_flag_parses_mib_or_auto_and_is_ignored_on_numpy():
    assert parse_expert_cache_mib(None) is None and parse_expert_cache_mib("auto") == "auto"
    assert parse_expert_cache_mib("2048") == 2048
    with pytest.raises(ValueError, match="--expert-cache-mib takes a MiB count or auto"):
        parse_expert_cache_mib("lots")
    with pytest.raises(ValueError, match="must be positive"):
        parse_expert_cache_mib("0")
    assert configure_expert_cache(NumpyBackend(), "512") is None


def test_serve_takes_expert_cache_mib_as_mib_or_auto():
    from api.config_load import load_config

    assert load_config([], environ={}).expert_cache_mib == ""
    assert load_config(["--expert-cache-mib", "auto"], environ={}).expert_cache_mib == "auto"
    assert load_config([], environ={"STRATA_EXPERT_CACHE_MIB": "4096"}).expert_cache_mib == "4096"
    with pytest.raises(ValueError, match="--expert-cache-mib takes a MiB count > 0 or auto"):
        load_config(["--expert-cache-mib", "-5"], environ={})


def test_metrics_name_every_figure_expert_cache(make_backend, tmp_path):
    """/metrics after a run: uses by layer and result, bytes moved, slots; every new series says expert_cache."""
    from scheduler.metrics import Metrics

    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, router_scale=0.3)
    backend, cache = make_backend(4)
    greedy_and_logits(load_model(tmp_path / "m.gguf", backend)[0], PROMPT, steps=3)
    metrics = Metrics()
    before = {m.name for m in metrics.registry.collect()}
    metrics.watch_expert_cache(cache)
    text = metrics.render().decode()
    s = cache.stats()
    hits0, misses0 = s["expert_cache_layers"][0]
    assert f'strata_expert_cache_uses_total{{layer="0",result="hit"}} {float(hits0)}' in text
    assert f'strata_expert_cache_uses_total{{layer="0",result="miss"}} {float(misses0)}' in text
    assert f"strata_expert_cache_loaded_bytes_total {float(s['expert_cache_loaded_bytes'])}" in text
    assert 'strata_expert_cache_slots{state="total"} 4.0' in text
    added = {m.name for m in metrics.registry.collect()} - before
    assert added and all(name.startswith("strata_expert_cache_") for name in added)
    metrics.render()  # a second read adds nothing: counters follow the cache's totals
    assert f'strata_expert_cache_uses_total{{layer="0",result="hit"}} {float(hits0)}' in metrics.render().decode()


def test_serve_counts_the_arena_as_engine_ram_and_wires_metrics_and_admission(make_backend, tmp_path,
                                                                              monkeypatch):
    from api.config_load import load_config
    from api.serve import build_state
    from engine.loader import open_model
    from scheduler.memory import sizing

    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, router_scale=0.3, expert_quant="Q8_0")
    backend, _ = make_backend()
    loaded = open_model(str(tmp_path / "m.gguf"), backend=backend, fetch=False, expert_cache_mib="0.03")
    cache = backend.expert_cache
    planned = []
    real_plan = sizing.plan_memory
    monkeypatch.setattr("scheduler.engine_build.plan_memory", lambda engine_bytes, *a, **k: planned.append(engine_bytes)
                        or real_plan(engine_bytes, *a, **k))
    config = load_config(["--model", str(tmp_path / "m.gguf"), "--expert-cache-mib", "0.03", "--ctx-size", "64",
                          "--batch", "1", "--backend", "cuda"], environ={})
    state = build_state(config, loaded)
    holders = state.engine.memory.holders  # one holder, one name: the expert cache's budget under the admission
    assert list(holders) == ["moe_experts"] and holders["moe_experts"].user.cache is cache
    assert planned == [cache.host_arena_bytes] and planned[0] > 0
    greedy_and_logits(loaded.model, PROMPT, steps=2)
    assert cache.num_slots == int(0.03 * 2**20) // cache.slot_bytes < cache.total_experts
    assert "strata_expert_cache_slots" in state.metrics.render().decode()


def test_auto_takes_every_expert_when_the_arena_has_room(make_backend, tmp_path, monkeypatch):
    from engine.backends.cuda.expert_cache import cache as cuda_expert_cache

    monkeypatch.setattr(cuda_expert_cache, "AUTO_HEADROOM_BYTES", 0)
    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, router_scale=0.3)
    backend, _ = make_backend()
    cache = configure_expert_cache(backend, "auto")
    greedy_and_logits(load_model(tmp_path / "m.gguf", backend)[0], PROMPT, steps=2)
    assert cache.num_slots == cache.total_experts == 16
    assert cache.loads == cache.stats()["expert_cache_misses"] <= 16  # only first uses load


def test_served_on_two_stages_the_cached_layers_run_off_the_event_loop_and_match_numpy(make_backend, tmp_path):
    """Through the server's pipeline (2 stages, 2 groups): each MoE layer's read-back waits on a worker thread,
    never on the event loop's (CudaBackend.create_step_runner), and the tokens are numpy's."""
    import asyncio
    import threading

    from engine.loader import open_model
    from scheduler.request import Request, SamplingParams
    from tests.support.reference_helpers import greedy_with_logits
    from tests.support.server_harness import run_on_app

    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, router_scale=0.3, expert_quant="Q8_0")
    backend, _ = make_backend()
    loaded = open_model(str(tmp_path / "m.gguf"), backend=backend, fetch=False, expert_cache_mib="0.03")
    cache, threads = backend.expert_cache, set()
    begin = cache.begin
    cache.begin = lambda *a, **k: threads.add(threading.current_thread().name) or begin(*a, **k)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [list(PROMPT), [5, 9, 2, 7, 11, 4]]

    async def work(state, client):
        async def consume(i, prompt):
            return [t async for d in state.engine.submit(Request(f"r{i}", prompt, params)) for t in d.token_ids]

        return await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))

    got = run_on_app(loaded, work, layer_split="1", batch=2, batch_groups="2")
    reference = load_model(tmp_path / "m.gguf", NumpyBackend())[0]
    assert got == [greedy_with_logits(reference, p, 4, chunk=16, kv_type="f16")[0] for p in prompts]
    assert threads and threading.main_thread().name not in threads, threads
    assert cache.stats()["expert_cache_misses"] > 0 and set(cache.stats()["expert_cache_layers"]) == {0, 1}
