"""Warm-up: run a model's first steps before anyone waits on them.

The numpy backend's kernels are numba functions, compiled on their first call: one machine-code version
per argument types (the weights' GGUF types and form, the K/V pool's dtype), kept in numba's disk cache
(beside the sources in engine/backends/__pycache__, or under $NUMBA_CACHE_DIR). The first start after an
install, or the first with a model of new weight or K/V types, compiled them inside the first request
(~47 s, issue 26) while /health already said healthy. `warm_model` runs the code paths a server's first
requests take, on a runner of its own, so that they are compiled (or read from numba's cache) before the
server says it is ready (api/serve.py) and, from `strata pull`, before the server's first start:

    sequence A: 20 prompt tokens       a chunk of 16   (T > KERNEL_MAX_ROWS: dequantised tiles + BLAS)
                                       a chunk of 4    (T <= KERNEL_MAX_ROWS, unfused: the few-row kernels)
                                       decode 1 token  (the fused decode step, one sequence)
    sequence B: 3 prompt tokens        beside A's next decode token (a mixed step: unfused, few rows)
    A and B                            decode 1 token each (the fused decode step, a batch)

Its runner has a K/V pool of WARMUP_BLOCKS blocks of its own and is dropped afterwards, so the server's
pool, its conversation cache and their integrity check never see it. The CUDA backend compiles (NVRTC, its
own disk cache) and loads every kernel when the model loads (engine/loader.py), so there is nothing to
warm there.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from engine.model import Model
from engine.sequence import ModelRunner, Sequence

log = logging.getLogger("strata.warmup")
WARMUP_BLOCKS = 8  # the plan's two sequences take 3 blocks of 16 tokens; room for a smaller block size
PROMPT_LENS = (20, 3)  # sequences A and B
# (what the step exercises, [(sequence, new tokens)]); decode steps first append one token to their sequence.
PLAN: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = (
    ("prefill chunk", ((0, 16),)),
    ("few-token chunk", ((0, 4),)),
    ("decode", ((0, 1),)),
    ("decode beside a prompt", ((0, 1), (1, 3))),
    ("batched decode", ((0, 1), (1, 1))),
)


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did: kernel versions numba compiled (and wrote to its cache) or read from its cache,
    where that cache is, and how long the whole warm-up took."""

    seconds: float
    compiled: int
    loaded: int
    cache_dirs: tuple[str, ...]
    kv_type: str

    def describe(self) -> str:
        steps = f"{', '.join(name for name, _ in PLAN)}; K/V {self.kv_type}"
        if not (self.compiled or self.loaded):
            return f"every kernel was already loaded, {self.seconds:.1f} s ({steps})"
        return (f"{self.compiled} kernel versions compiled, {self.loaded} read from numba's cache at "
                f"{', '.join(self.cache_dirs)}, in {self.seconds:.1f} s ({steps})")


def warm_model(model: Model, kv_type: str, layer_split: tuple[int, ...] = ()) -> WarmupReport | None:
    """Compile (or load from numba's disk cache) the kernels `model`'s steps run with K/V stored as
    `kv_type` (resolved, never "auto") over `layer_split`, by running PLAN on a runner and pool of its own;
    logs what it did and returns it. None on a backend that compiles nothing lazily (cuda). Changes no
    state of anything else (the backend builds the model's fused decoder if nothing had yet)."""
    if not model.backend.capabilities.compiles_lazily:
        return None
    started = time.perf_counter()
    before = kernel_counts()
    runner = ModelRunner(model, WARMUP_BLOCKS, kv_type=kv_type, layer_split=layer_split)
    run_plan(runner)
    hits, misses, dirs = kernel_counts()
    report = WarmupReport(time.perf_counter() - started, misses - before[1], hits - before[0], dirs, kv_type)
    log.info("warm-up of %s: %s", model.config.arch, report.describe(),
             extra={"fields": {"warmup_seconds": round(report.seconds, 3), "kernels_compiled": report.compiled,
                               "kernels_loaded": report.loaded, "numba_cache_dirs": list(report.cache_dirs)}})
    return report


def run_plan(runner: ModelRunner) -> None:
    """PLAN's steps through `runner.step` on block ids of its standalone free list, all given back at the
    end. Must be called before the runner's blocks are handed to a conversation cache (claim_blocks)."""
    vocab = runner.model.config.vocab_size
    seqs = [Sequence([(7 + 31 * i) % vocab for i in range(n)]) for n in PROMPT_LENS]
    try:
        for _, work in PLAN:
            for index, n in work:
                seq = seqs[index]
                if not seq.num_pending:  # a decode step: the token the previous step would have sampled
                    seq.token_ids.append((seq.token_ids[-1] + 1) % vocab)
                assert seq.num_pending >= n, f"warm-up plan: {n} tokens asked of {seq.num_pending} pending"
                if not runner.ensure_blocks(seq, seq.num_computed + n):
                    raise MemoryError(f"warm-up: {runner.layout.num_blocks} blocks cannot hold its sequences")
            runner.step([(seqs[index], n) for index, n in work])
    finally:
        for seq in seqs:
            runner.release(seq)


def kernel_counts() -> tuple[int, int, tuple[str, ...]]:
    """(versions read from numba's disk cache, versions compiled, the cache folders they went through),
    summed over every numba function of the loaded engine modules, since the process started."""
    from numba.core.dispatcher import Dispatcher

    hits = misses = 0
    dirs: set[str] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("engine.") or module is None:
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, Dispatcher) or value.py_func.__module__ != name:
                continue  # not a numba function, or one imported from another module (counted there)
            stats = value.stats
            hits += sum(stats.cache_hits.values())
            misses += sum(stats.cache_misses.values())
            if stats.cache_path and (stats.cache_hits or stats.cache_misses):
                dirs.add(stats.cache_path)
    return hits, misses, tuple(sorted(dirs))
