"""`strata kernels --check`: compile every source for each arch and report what ptxas says per kernel."""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO

from cuda_kernels import build, registry

_ARCH = re.compile(r"^sm_\d{2,3}[af]?$")


def validate_arch(arch: str) -> str:
    if not _ARCH.match(arch):
        raise ValueError(f"--arch {arch!r} is not an arch name like sm_90 (known: {', '.join(build.SUPPORTED_ARCHS)})")
    return arch


def compile_matrix(archs, workers: int | None = None) -> tuple[list[build.CompiledSource], list[build.CompileError]]:
    """Every (source, arch) compiled (from the cache where possible), on a small thread pool: NVRTC
    releases the GIL while it compiles. Returns (successes, failures) in (arch, source) order."""
    workers = workers or min(4, os.cpu_count() or 1)
    jobs = [(name, arch) for arch in archs for name in registry.SOURCES]

    def run(job):
        try:
            return build.compile_source(*job)
        except build.CompileError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run, jobs))
    compiled = [r for r in results if isinstance(r, build.CompiledSource)]
    failures = [r for r in results if isinstance(r, build.CompileError)]
    return compiled, failures


def print_report(compiled: list[build.CompiledSource], out: TextIO) -> int:
    """One line per (kernel, arch): compile ms (of its source file), registers, static shared bytes, spills.
    Returns how many declared kernels were missing from their cubin."""
    missing = 0
    header = f"{'kernel':<28} {'source':<16} {'arch':<7} {'compile ms':>10} {'registers':>9} {'shared B':>9} {'spill B':>8}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for source in compiled:
        for kernel in registry.SOURCES[source.name]:
            res = source.kernels.get(kernel)
            if res is None:  # declared but absent from the cubin: worth a visible line, not a crash
                print(f"{kernel:<28} {source.name:<16} {source.arch:<7} missing from the cubin", file=out)
                missing += 1
                continue
            ms = f"{source.compile_ms:.0f}" + (" (cached)" if source.cached else "")
            print(
                f"{kernel:<28} {source.name:<16} {source.arch:<7} {ms:>10} {res.registers:>9} "
                f"{res.shared_bytes:>9} {res.spill_bytes:>8}",
                file=out,
            )
    return missing


def run_check(archs, out: TextIO, err: TextIO) -> int:
    """The CLI command: 0 when every source compiles for every arch, 1 (with NVRTC's log) otherwise."""
    archs = [validate_arch(a) for a in archs]
    compiled, failures = compile_matrix(archs)
    missing = print_report(compiled, out)
    for failure in failures:
        print(f"\n{failure}", file=err)
    return 1 if failures or missing else 0
