"""How the event loop learns that a CUDA step finished: the waiter thread against polling with backoff, on the
emulated driver of tests/support/fake_cuda_async.py (streams on threads of their own; no GPU needed).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_event_wait.py [--steps 200] [--device-ms 1,10]

Each step enqueues `device-ms` of "device work" (a sleep on the stream's thread), records an event and awaits
it through CudaBackend.wait. Per mode and step length: wake latency (event complete -> the await returns;
p50 / p99), CPU seconds per step of the loop thread and of the whole process (the waiter thread included).
On a GPU, scripts/bench_cuda.py measures the same two modes against the real driver.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from tests.support import fake_cuda_async  # noqa: E402


async def _steps(backend, driver, steps: int, device_s: float) -> dict:
    latencies, loop_cpu, process_cpu = [], 0.0, 0.0
    for _ in range(steps):
        done_at = []

        def device_work():
            time.sleep(device_s)
            done_at.append(time.perf_counter())

        backend.device.ensure_current()
        driver.run_on_stream(backend.stream, device_work)
        event = backend.record_event()
        cpu, proc = time.thread_time(), time.process_time()
        await backend.wait(event)
        woke = time.perf_counter()
        loop_cpu += time.thread_time() - cpu
        process_cpu += time.process_time() - proc
        backend.release_event(event)
        latencies.append(woke - done_at[0])
    latencies.sort()
    return {"p50_us": 1e6 * statistics.median(latencies), "p99_us": 1e6 * latencies[int(0.99 * (len(latencies) - 1))],
            "loop_cpu_us": 1e6 * loop_cpu / steps, "process_cpu_us": 1e6 * process_cpu / steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device-ms", default="1,10")
    args = parser.parse_args()
    monkeypatch = pytest.MonkeyPatch()
    driver = fake_cuda_async.install(monkeypatch)
    from engine.backends.cuda.backend import CudaBackend

    print("| wait mode | device work per step | wake latency p50 (us) | p99 (us) | loop-thread CPU per step (us) | "
          "process CPU per step (us) |\n| --- | --- | --- | --- | --- | --- |")
    for device_ms in (float(v) for v in args.device_ms.split(",")):
        for mode in ("thread", "poll"):
            backend = CudaBackend(wait_mode=mode, graphs=False)
            row = asyncio.run(_steps(backend, driver, args.steps, device_ms / 1e3))
            print(f"| {mode} | {device_ms:g} ms | {row['p50_us']:.0f} | {row['p99_us']:.0f} | {row['loop_cpu_us']:.0f} | "
                  f"{row['process_cpu_us']:.0f} |", flush=True)
            backend.close()
    driver.close()
    monkeypatch.undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
