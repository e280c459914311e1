"""The servers of scripts/bench_peer.py: started as processes of their own, both up at once, and the machine
they ran on (CPU, SIMD, RAM, load) for the record beside the numbers."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f in flags]
    mem_kib = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                       if ln.startswith("MemTotal")))
    return f"{name}, {os.cpu_count()} cpus ({' '.join(simd)}), {mem_kib / 2**20:.0f} GiB RAM"


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """One server process, up until stop(); url, pid."""

    def __init__(self, name: str, command: list[str], port: int, checkout: str | None = None):
        # PYTHONPATH: the `strata` entry point imports whichever checkout the venv was installed from; this one
        # benchmarks the checkout it lives in, or `checkout` (another tree of the same project, for a before/after).
        env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
               "PYTHONPATH": checkout or str(Path(__file__).resolve().parents[1])}
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def wait_ready(self, timeout_s: float = 1800) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /health in {timeout_s:.0f} s")

    def peak_rss_mib(self) -> float:
        return peak_rss_mib(self.process.pid)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_all(specs: list[tuple]) -> list[Server]:
    """Servers from (name, command, port[, checkout]) each, started together and ready; none left running on a
    failure."""
    servers = [Server(*spec) for spec in specs]
    try:
        for server in servers:
            server.wait_ready()
    except Exception:
        for server in servers:
            server.stop()
        raise
    return servers


def alternate(servers: list[Server], round_index: int) -> list[Server]:
    """Who goes first rotates round by round, so none always runs into another's tail."""
    shift = round_index % len(servers)
    return servers[shift:] + servers[:shift]
