"""Issue 26: no first request waits for compilation. `strata serve` listens while it loads (/health 503
"loading", every other route 503) and warms the model's kernels before it says ready (engine/warmup.py,
api/serve.py); `strata pull` warms them too unless told --no-warm."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from api.config import ServerConfig
from api.serve import create_server, load_state
from api.server import LOADING_RETRY_S, LoadingState
from engine import warmup
from tests.support.server_harness import running_server

CHAT = "/v1/chat/completions"
HI = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def _config(smollm2) -> ServerConfig:
    """As tests/support/server_harness.py's: the served name is "smollm2" (--model), the model itself `smollm2`."""
    return ServerConfig(port=0).replace(model="smollm2", conversation_cache_mib=64, ctx_size=512, batch=2)


@contextlib.contextmanager
def loading_server(config: ServerConfig, load):
    """(url, server) of a server that listens while `load` runs; stopped afterwards."""
    server = create_server(LoadingState(config), port=0, load=load)
    thread = threading.Thread(target=server.run, name="strata-test-loading-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", server, thread
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _gated(gate: threading.Event, load):
    """A load that waits for the test to open `gate` first (the slow load of a real model, on demand)."""
    def run():
        assert gate.wait(timeout=60), "the test never opened the gate"
        return load()
    return run


def _wait_healthy(url: str) -> httpx.Response:
    deadline = time.monotonic() + 600  # an empty numba cache: the warm-up compiles (minutes on a busy CPU)
    while (response := httpx.get(url + "/health", timeout=5)).status_code != 200:
        assert response.json() == {"status": "loading"} and time.monotonic() < deadline, response.text
        time.sleep(0.05)
    return response


def test_health_says_loading_until_the_model_is_loaded_then_ok(smollm2):
    gate, config = threading.Event(), _config(smollm2)
    with loading_server(config, _gated(gate, lambda: load_state(config, smollm2))) as (url, _, _):
        response = httpx.get(url + "/health", timeout=5)
        assert (response.status_code, response.json()) == (503, {"status": "loading"})
        gate.set()
        assert _wait_healthy(url).json() == {"status": "ok"}
        reply = httpx.post(url + CHAT, json=HI, timeout=120)
        assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("method, path", [("POST", CHAT), ("GET", "/v1/models"), ("POST", "/tokenize"),
                                          ("GET", "/metrics")])
def test_other_routes_answer_503_in_the_openai_error_shape_while_loading(smollm2, method, path):
    gate = threading.Event()
    with loading_server(_config(smollm2), _gated(gate, lambda: None)) as (url, _, _):
        response = httpx.request(method, url + path, json={"content": "Hi"} if method == "POST" else None,
                                 timeout=5)
    gate.set()  # after the stop: what the load then returns is dropped
    assert response.status_code == 503, response.text
    assert response.json() == {"error": {
        "message": f"The server cannot take this request now (the model is still loading); retry after "
                   f"{LOADING_RETRY_S} s", "type": "service_unavailable", "param": None,
        "code": "server_is_overloaded"}}
    assert response.headers["retry-after"] == str(LOADING_RETRY_S)


def test_the_messages_route_answers_in_anthropics_overloaded_shape_while_loading(smollm2):
    gate = threading.Event()
    with loading_server(_config(smollm2), _gated(gate, lambda: None)) as (url, _, _):
        response = httpx.post(url + "/v1/messages", json={}, timeout=5)
    gate.set()
    assert response.status_code == 529, response.text  # Anthropic's "overloaded", as for a full queue
    assert response.json() == {"type": "error", "error": {"type": "overloaded_error", "message": (
        f"The server cannot take this request now (the model is still loading); retry after {LOADING_RETRY_S} s")}}


def test_a_stop_while_loading_exits_at_once_without_waiting_for_the_load(smollm2):
    gate = threading.Event()
    with loading_server(_config(smollm2), _gated(gate, lambda: None)) as (_, server, thread):
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler does on SIGTERM
        assert server.strata_state.is_shutting_down  # /health: 503 "shutting down" until the socket closes
        thread.join(timeout=10)
        assert not thread.is_alive(), "the server waited for the load to finish"
    gate.set()
    assert isinstance(server.strata_state, LoadingState) and server.load_error is None


def test_a_load_that_raises_stops_the_server_and_keeps_the_error(smollm2):
    def load():
        raise FileNotFoundError("no such model: nowhere.gguf")

    with loading_server(_config(smollm2), load) as (_, server, thread):
        thread.join(timeout=10)
        assert not thread.is_alive(), "the server kept running after its load failed"
    assert isinstance(server.load_error, FileNotFoundError) and "nowhere.gguf" in str(server.load_error)


def test_the_warm_up_leaves_the_conversation_cache_empty_and_consistent(smollm2):
    state = load_state(_config(smollm2), smollm2)
    usage = state.engine.cache.usage()
    assert (usage["device_cached"], usage["device_in_use"], usage["host_cached"]) == (0, 0, 0)
    state.engine.cache.check_integrity()
    state.engine.runner.check_stages()


def test_after_the_warm_up_the_first_requests_compile_and_load_no_kernel(smollm2):
    report = warmup.warm_model(smollm2.model, "f16")
    assert report is not None and report.kv_type == "f16"
    before = warmup.kernel_counts()
    with running_server(smollm2, ctx_size=512, batch=2) as (url, _):
        statuses = []
        with httpx.Client(timeout=60) as client:  # one alone, then two at once (a batched decode)
            statuses.append(client.post(url + CHAT, json=HI).status_code)
            threads = [threading.Thread(target=lambda: statuses.append(client.post(url + CHAT, json=HI).status_code))
                       for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    assert statuses == [200, 200, 200]
    assert warmup.kernel_counts()[:2] == before[:2]


def test_a_second_warm_up_in_the_same_process_compiles_and_loads_nothing(smollm2):
    warmup.warm_model(smollm2.model, "f16")
    again = warmup.warm_model(smollm2.model, "f16")
    assert (again.compiled, again.loaded) == (0, 0)
    assert again.describe().startswith("every kernel was already loaded")


# -- strata pull -----------------------------------------------------------------------------------------

def _no_warm_up(*args, **kwargs):
    raise AssertionError("the warm-up ran")


def test_pull_warms_the_model_it_fetched(smollm2_path, monkeypatch, capsys):
    from api import cli

    calls = []
    monkeypatch.setattr(cli, "resolve_model", lambda name: smollm2_path)
    monkeypatch.setattr(warmup, "warm_model", lambda model, kv_type: calls.append((model.config.arch, kv_type)))
    assert cli.main(["pull", "smollm2"]) == 0
    assert calls == [("llama", "f16")]
    assert capsys.readouterr().out == f"{smollm2_path}\n"


def test_pull_no_warm_only_fetches(monkeypatch, capsys):
    from api import cli

    monkeypatch.setattr(cli, "resolve_model", lambda name: Path("/models/x.gguf"))
    monkeypatch.setattr(warmup, "warm_model", _no_warm_up)
    assert cli.main(["pull", "--no-warm", "smollm2"]) == 0
    assert capsys.readouterr().out == "/models/x.gguf\n"


def test_pull_list_warms_nothing(monkeypatch, tmp_path, capsys):
    from api import cli

    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    monkeypatch.setattr(warmup, "warm_model", _no_warm_up)
    assert cli.main(["pull", "--list"]) == 0
    assert "qwen2.5-coder-0.5b (default)" in capsys.readouterr().out
