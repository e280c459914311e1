"""Benchmark of the numpy backend on one model: load time, prefill and decode throughput, peak RSS.

    .venv/bin/python scripts/bench_model.py [--model smollm2] [--threads 2] [--repeats 3]
                                            [--cpu-weights quantized,quantized-f32act,quantized-unfused,f32]

Prints a markdown table (medians over repeats) and the BLAS setup, so runs are comparable. Decode at
batch B runs B sequences of 128 context tokens through one batched step per token. With several
--cpu-weights values each runs in a fresh process, one after the other (peak RSS is per process), and the
table has one column per value. "first step" is the first prefill after load: it includes loading (or, on
the first run after an install, compiling) the numba kernels. The machine is shared: the load average is
printed beside the figures; so is CPU time per decode step (--profile), which a busy machine inflates
less than wall time. `quantized-f32act` is `quantized` with float32 activations in the decode products
(no int8 quantisation); `quantized-unfused` is that with the fused decode step off
(engine/backends/cpu/fused_decoder.py): every decode step then runs the per-op path.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from threadpoolctl import threadpool_info  # noqa: E402

from engine.cpu_threads import limit_threads  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.sequence import ModelRunner, Sequence  # noqa: E402
from engine.units import MIB  # noqa: E402


def bench_prefill(runner: ModelRunner, n_tokens: int, chunk: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        seq = Sequence([(i * 7 + r) % 1000 + 10 for i in range(n_tokens)])
        runner.ensure_blocks(seq, n_tokens)
        t0 = time.perf_counter()
        while seq.num_pending:
            runner.step([(seq, min(chunk, seq.num_pending))])
        times.append(time.perf_counter() - t0)
        runner.release(seq)
    return n_tokens / statistics.median(times)


def bench_decode(runner: ModelRunner, batch: int, steps: int, repeats: int, context: int = 128) -> float:
    rates = []
    for r in range(repeats):
        seqs = [Sequence([(i * 13 + b + r) % 1000 + 10 for i in range(context)]) for b in range(batch)]
        for seq in seqs:
            runner.ensure_blocks(seq, context + steps)
        runner.step([(s, context) for s in seqs])
        t0 = time.perf_counter()
        for _ in range(steps):
            for s in seqs:
                s.token_ids.append(42)
            runner.step([(s, 1) for s in seqs])
        rates.append(batch * steps / (time.perf_counter() - t0))
        for s in seqs:
            runner.release(s)
    return statistics.median(rates)


def copy_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Read + write bandwidth of one large array copy (GB/s of bytes moved), the machine's practical limit."""
    src = np.ones(mib * MIB // 4, dtype=np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / min(times) / 1e9


def bytes_read_per_decode_step(weights) -> int:
    """Weight bytes every decode step streams: each layer's matrices and the output head."""
    per_layer = sum(m.nbytes for lw in weights.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
    return per_layer + weights.output.nbytes


def profile_decode(runner: ModelRunner, batch: int, steps: int = 16) -> dict[str, float]:
    """Milliseconds per decode step spent in each Backend op (wraps the backend's methods)."""
    backend, totals = runner.model.backend, {}
    names = ["linear", "attention", "rms_norm", "add_rms_norm", "rope", "store_kv", "gated_activation"]
    originals = {n: getattr(backend, n) for n in names}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapper

    for n in names:
        setattr(backend, n, timed(n, originals[n]))
    seqs = [Sequence([(i * 13 + b) % 1000 + 10 for i in range(128)]) for b in range(batch)]
    try:
        for seq in seqs:
            runner.ensure_blocks(seq, 128 + steps)
        runner.step([(seq, 128) for seq in seqs])
        totals.clear()  # decode steps only
        t0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            for seq in seqs:
                seq.token_ids.append(42)
            runner.step([(seq, 1) for seq in seqs])
        totals["whole step"] = time.perf_counter() - t0
        totals["whole step (CPU, all threads)"] = time.process_time() - cpu0
    finally:
        for seq in seqs:
            runner.release(seq)
        for n in names:
            delattr(backend, n)  # back to the class methods
    return {k: v / steps * 1e3 for k, v in totals.items()}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--cpu-weights", default="quantized,f32",
                    help="comma-separated: quantized (int8 activations), quantized-f32act, quantized-unfused "
                         "(fused decode step off), f32")
    ap.add_argument("--profile", action="store_true", help="also print ms per decode step by Backend op")
    ap.add_argument("--bandwidth", action="store_true", help="also measure np.copyto bandwidth (after peak RSS)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON (used for the comparison)")
    return ap.parse_args()


def measure(args) -> tuple[list[tuple[str, str]], dict, str]:
    """(rows, ms-per-op profiles, header line) for one --cpu-weights value in this process."""
    with limit_threads(args.threads):
        t0 = time.perf_counter()
        unfused = args.cpu_weights == "quantized-unfused"
        loaded = open_model(args.model, max_positions=4096,
                            cpu_weights="quantized-f32act" if unfused else args.cpu_weights)
        if unfused:
            loaded.model.backend.fused_decode = False
        load_s = time.perf_counter() - t0
        runner = ModelRunner(loaded.model, num_blocks=4096 // 16 * 3, block_size=16)
        t0 = time.perf_counter()
        bench_prefill(runner, 64, args.chunk, 1)  # warm-up; the first kernel calls load or compile them
        rows = [("load (s)", f"{load_s:.2f}"), ("first step, 64-token prefill (s)", f"{time.perf_counter() - t0:.2f}")]
        for n in (128, 512, 2048):
            rows.append((f"prefill {n} tok (tok/s, chunk {args.chunk})", f"{bench_prefill(runner, n, args.chunk, args.repeats):.0f}"))
        step_bytes = bytes_read_per_decode_step(loaded.model.weights)
        for b in (1, 4, 8):
            rate = bench_decode(runner, b, args.decode_steps, args.repeats)
            rows.append((f"decode batch {b} (tok/s)", f"{rate:.1f}"))
            rows.append((f"decode batch {b}: weight bytes streamed (GB/s)", f"{step_bytes * rate / b / 1e9:.1f}"))
        rows.append(("weight bytes read per decode step (MB)", f"{step_bytes / 1e6:.0f}"))
        profiles = {b: profile_decode(runner, b) for b in (1, 4)} if args.profile else {}
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append(("peak RSS (MiB)", f"{rss_mib:.0f}"))
        if args.bandwidth:  # after the RSS reading: the copy's 1 GiB of buffers is not the model's
            rows.append(("copy bandwidth, np.copyto 512 MiB (GB/s)", f"{copy_bandwidth_gbs():.1f}"))
        blas = [(i.get("internal_api"), i.get("num_threads"), i.get("architecture")) for i in threadpool_info()]
    header = (f"model {loaded.path.name}: {loaded.info.weight_bytes / MIB:.0f} MiB of weights ({args.cpu_weights}); "
              f"BLAS {blas}")
    return rows, profiles, header


def compare(args, values: list[str]) -> int:
    """Run each --cpu-weights value in its own process, one after the other; one column per value."""
    results = []
    for value in values:
        cmd = [sys.executable, __file__, "--json", "--cpu-weights", value] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("cpu_weights", "json", "profile", "bandwidth") and v is not None]
        results.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    for r in results:
        print(r["header"])
    print(f"load average {os.getloadavg()[0]:.2f} (after the runs); threads {args.threads}")
    print("| measure | " + " | ".join(values) + " |\n| --- |" + " --- |" * len(values))
    for i, (name, _) in enumerate(results[0]["rows"]):
        print(f"| {name} | " + " | ".join(r["rows"][i][1] for r in results) + " |")
    return 0


def main() -> int:
    args = parse_args()
    values = [v.strip() for v in args.cpu_weights.split(",") if v.strip()]
    if len(values) > 1:
        return compare(args, values)
    rows, profiles, header = measure(args)
    if args.json:
        print(json.dumps({"rows": rows, "header": header}))
        return 0
    print(header)
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')} OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE')}"
          f" load average {os.getloadavg()[0]:.2f}")
    print("| measure | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    for b, ms in profiles.items():
        print(f"decode batch {b}, ms per step (context 128): "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ms.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
