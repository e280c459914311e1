"""Benchmark of the CUDA backend: throughput, bandwidth, per-kernel times, completion latency.

    python3 scripts/bench_cuda.py [--models default,1b] [--quant Q8_0] [--decode-steps 32] [--kv-types f16]

Prints markdown tables for the default model (when its file is already cached: nothing is fetched) and for
a 1B-class llama-shaped model with random weights written here (scripts/bench_cuda_model.py, cached in /tmp):
- prefill and decode tokens/s at batch 1, 4 and 16 (decode replays CUDA graphs, as the server does), per
  --kv-types entry (default f16, the server's CUDA default; int8 and f32 on request);
- decode bandwidth: bytes of the linear weights read per step / step time, against the card's device copy
  bandwidth (cuMemcpyDtoD of a 1 GiB buffer, bytes read + written);
- GPU time per kernel (events around every launch, graphs off) for one prefill and some decode steps;
- how long after a step's end the event loop notices it, waiter thread vs polling (cuda/wait.py).
On a machine without a usable GPU it says why and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.cuda.device import probe  # noqa: E402
from engine.units import MIB  # noqa: E402

BATCHES = (1, 4, 16)
PREFILL_TOKENS = 256  # per sequence
BLOCK = 16


def main() -> int:
    parser = argparse.ArgumentParser(description="CUDA backend benchmark")
    parser.add_argument("--models", default="default,1b", help="comma list of: default, 1b, or .gguf paths")
    parser.add_argument("--quant", default="Q8_0", choices=("Q8_0", "Q4_0"), help="weights of the 1b model")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--kv-types", default="f16", help="comma list of K/V types to measure (f16, int8, f32)")
    args = parser.parse_args()
    available, reason = probe(args.device)
    if not available:
        print(f"no CUDA device: {reason}")
        return 0
    from engine.backends.cuda.backend import CudaBackend

    backend = CudaBackend(device=args.device)
    print(f"# CUDA backend on {backend.device.name}, {backend.device.sm_count} SMs\n")
    copy_gbps = copy_bandwidth(backend)
    print(f"device copy bandwidth (1 GiB cuMemcpyDtoD, read + written): {copy_gbps:.0f} GB/s\n")
    print_latency_table(backend)
    for spec in args.models.split(","):
        path = model_path(spec.strip(), args.quant)
        if path is None:
            continue
        bench_model(backend, path, copy_gbps, args.decode_steps, args.kv_types.split(","))
    return 0


def model_path(spec: str, quant: str) -> Path | None:
    if spec == "1b":
        from scripts.bench_cuda_model import write_bench_model

        return write_bench_model(Path(f"/tmp/strata-bench-1b-{quant}.gguf"), quant)
    from engine.model_store import default_model_name, resolve_model

    name = default_model_name() if spec == "default" else spec
    try:
        return resolve_model(name, fetch=False)
    except (FileNotFoundError, ValueError) as exc:
        print(f"(skipping {name}: {exc})\n")
        return None


def copy_bandwidth(backend, nbytes: int = 2**30, repeats: int = 10) -> float:
    """GB/s of device-to-device copies, counting bytes read and written."""
    from engine.backends.cuda.device import check, driver

    device, stream = backend.device, backend.stream
    src, dst = device.alloc(nbytes, "copy benchmark"), device.alloc(nbytes, "copy benchmark")
    start, end = device.create_event(timing=True), device.create_event(timing=True)
    try:
        device.dtod(dst, src, nbytes, stream)  # warm-up
        check(driver.cuEventRecord(start, stream))
        for _ in range(repeats):
            device.dtod(dst, src, nbytes, stream)
        check(driver.cuEventRecord(end, stream))
        check(driver.cuEventSynchronize(end))
        ms = check(driver.cuEventElapsedTime(start, end))
    finally:
        device.unreserve(src)
        device.unreserve(dst)
    return 2 * nbytes * repeats / (ms / 1e3) / 1e9


def print_latency_table(backend, samples: int = 50) -> None:
    """After a GPU job of known length: wall time to the awaiting coroutine's wake-up minus the job's time."""
    from engine.backends.cuda.device import check, driver
    from engine.backends.cuda.wait import EventWaiter

    device, stream = backend.device, backend.stream
    nbytes = 256 * MIB  # a copy of ~0.1-0.2 ms stands in for a short step
    src, dst = device.alloc(nbytes, "latency benchmark"), device.alloc(nbytes, "latency benchmark")
    start, end = device.create_event(timing=True), device.create_event(timing=True)
    print("| completion | median us | p90 us | loop iterations while waiting |\n| --- | --- | --- | --- |")
    for mode in ("thread", "poll"):
        waiter = EventWaiter(mode, backend._event_done, backend._event_sync, device.make_current)
        overheads, ticks = [], []

        async def one() -> None:
            count = [0]

            async def ticker():
                while True:
                    count[0] += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            check(driver.cuEventRecord(start, stream))
            device.dtod(dst, src, nbytes, stream)
            check(driver.cuEventRecord(end, stream))
            await waiter.wait(end)
            wall_us = (time.perf_counter() - t0) * 1e6
            task.cancel()
            gpu_us = check(driver.cuEventElapsedTime(start, end)) * 1e3
            overheads.append(wall_us - gpu_us)
            ticks.append(count[0])

        for _ in range(samples):
            asyncio.run(one())
        waiter.close()
        overheads.sort()
        print(f"| {mode} | {statistics.median(overheads):.0f} | {overheads[int(0.9 * len(overheads))]:.0f} | "
              f"{statistics.median(ticks):.0f} |")
    device.unreserve(src)
    device.unreserve(dst)
    print()


def bench_model(backend, path: Path, copy_gbps: float, decode_steps: int, kv_types=("f16",)) -> None:
    from engine.backends.cuda.linear import QuantLinear
    from engine.model import load_model
    from engine.sequence import ModelRunner

    model, _, info = load_model(path, backend)
    c = model.config
    linear_bytes = sum(v.nbytes for layer in model.weights.layers for v in vars(layer).values()
                       if isinstance(v, QuantLinear)) + model.weights.output.nbytes
    print(f"## {path.name}: {c.n_layers} layers, d {c.d_model}, loaded in {info.load_seconds:.1f} s, "
          f"{linear_bytes / MIB:.0f} MiB of linear weights\n")
    print("| K/V | batch | prefill tok/s | decode tok/s | decode step ms | decode GB/s | of copy bandwidth |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    per_seq_blocks = -(-(PREFILL_TOKENS + decode_steps + 1) // BLOCK)
    for kv_type in kv_types:
        runner = ModelRunner(model, num_blocks=per_seq_blocks * max(BATCHES), block_size=BLOCK, kv_type=kv_type)
        _bench_batches(runner, kv_type, decode_steps, linear_bytes, copy_gbps)
    print()
    print_kernel_table(backend, runner, decode_steps)


def _bench_batches(runner, kv_type: str, decode_steps: int, linear_bytes: int, copy_gbps: float) -> None:
    from engine.sequence import Sequence

    for batch in BATCHES:
        seqs = [Sequence([(7 * i + 13 * b) % 1000 + 10 for i in range(PREFILL_TOKENS)]) for b in range(batch)]
        for seq in seqs:
            runner.ensure_blocks(seq, PREFILL_TOKENS + decode_steps + 1)
        runner.step([(seqs[0], 8)])  # warm-up: first launches load modules
        seqs[0].num_computed = 0
        t0 = time.perf_counter()
        logits = runner.step([(seq, PREFILL_TOKENS) for seq in seqs])
        prefill_s = time.perf_counter() - t0
        steps = []
        for step in range(decode_steps):
            for seq, row in zip(seqs, logits):
                seq.token_ids.append(int(row.argmax()))
            t0 = time.perf_counter()
            logits = runner.step([(seq, 1) for seq in seqs])
            steps.append(time.perf_counter() - t0)
        step_s = statistics.median(steps[2:])  # the first steps capture graphs
        gbps = linear_bytes / step_s / 1e9
        print(f"| {kv_type} | {batch} | {batch * PREFILL_TOKENS / prefill_s:.0f} | {batch / step_s:.0f} | "
              f"{step_s * 1e3:.2f} | {gbps:.0f} | {100 * gbps / copy_gbps:.0f}% |")
        for seq in seqs:
            runner.release(seq)


def print_kernel_table(backend, runner, decode_steps: int) -> None:
    """GPU time per kernel over one batch-4 prefill and decode_steps decode steps, graphs off."""
    from engine.backends.cuda.launch import KernelProfiler
    from engine.sequence import Sequence

    graphs, backend.graphs = backend.graphs, None
    backend.kernels.profiler = profiler = KernelProfiler(backend.device)
    try:
        seqs = [Sequence(list(range(10 + b, 10 + b + PREFILL_TOKENS))) for b in range(4)]
        for seq in seqs:
            runner.ensure_blocks(seq, PREFILL_TOKENS + decode_steps + 1)
        runner.step([(seq, PREFILL_TOKENS) for seq in seqs])
        for _ in range(decode_steps):
            for seq in seqs:
                seq.token_ids.append(11)
            runner.step([(seq, 1) for seq in seqs])
        totals = profiler.collect()
        for seq in seqs:
            runner.release(seq)
    finally:
        backend.kernels.profiler, backend.graphs = None, graphs
    whole = sum(ms for _, ms in totals.values()) or 1.0
    print(f"GPU time per kernel (batch 4: one prefill of {PREFILL_TOKENS} tokens + {decode_steps} decode steps)\n")
    print("| kernel | launches | total ms | us per launch | share |\n| --- | --- | --- | --- | --- |")
    for kernel, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kernel} | {n} | {ms:.2f} | {1e3 * ms / n:.1f} | {100 * ms / whole:.1f}% |")
    print()


if __name__ == "__main__":
    sys.exit(main())
