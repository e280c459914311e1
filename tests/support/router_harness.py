"""SGLang's router (PyPI `sglang-router`) in front of strata servers, for tests: install, start, wait.

The router is installed at run time into its own venv by scripts/install_router.sh (never a dependency of
strata); `router_python()` returns None when that fails (no network, no wheel for the platform), so a test
can skip.
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from api.config import ServerConfig
from api.sampling_defaults import store_entry_for
from api.serve import build_state, create_server

ROOT = Path(__file__).resolve().parents[2]


def router_python() -> str | None:
    """The router venv's python, installing it first if needed; None when the wheel cannot be installed."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "install_router.sh")], capture_output=True, text=True,
                          timeout=600)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """One strata server in this process on a fixed port, so it can be stopped and started again at the same
    URL the router knows (with the same disk tier, when `conversation_cache_dir` is set)."""

    def __init__(self, loaded, **config_fields):
        self.loaded = loaded
        self.port = free_port()
        entry = store_entry_for(loaded.path)  # --model as a user names it: requests for "smollm2" are served
        config_fields.setdefault("model", entry.name if entry is not None else str(loaded.path))
        self.config = ServerConfig(port=self.port).replace(**config_fields)
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = self.server = self.thread = None

    def start(self) -> "Replica":
        self.state = build_state(self.config, self.loaded)
        self.server = create_server(self.state, port=self.port)
        self.thread = threading.Thread(target=self.server.run, name=f"strata-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"replica on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Graceful stop, as SIGTERM does: finish in-flight work, flush the disk tier, close the socket."""
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=60)
            self.server = None


@contextlib.contextmanager
def running_router(python: str, worker_urls: list[str], log_path: Path, *router_args: str):
    """Yield the URL of `python -m sglang_router.launch_router` on 127.0.0.1 once every worker is healthy.

    Health is checked every second and one failure marks a worker unhealthy (one success brings it back), so
    a test sees a replica's loss and return within seconds; the defaults are 60 s and 3 failures."""
    port, metrics_port = free_port(), free_port()
    cmd = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--worker-urls", *worker_urls, "--health-check-interval-secs", "1",
           "--health-failure-threshold", "1", "--health-success-threshold", "1", *router_args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_workers(url, lambda ws: len(ws) == len(worker_urls) and all(w["is_healthy"] for w in ws),
                         process=process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_workers(router_url: str, condition, timeout_s: float = 60, process=None) -> list[dict]:
    """Poll the router's GET /workers until `condition(workers)` holds; the workers list."""
    deadline = time.monotonic() + timeout_s
    workers: list[dict] = []
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"router exited with status {process.returncode}")
        try:
            workers = httpx.get(router_url + "/workers", timeout=5).json()["workers"]
            if condition(workers):
                return workers
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"router workers never reached the expected state: {workers}")


def healthy(workers: list[dict]) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in workers}
