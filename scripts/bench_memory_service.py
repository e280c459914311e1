"""What the memory admission's coroutine path adds to one decode step's reservation.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_memory_service.py [--calls 200000]

A running request whose table already holds its next token (the common decode step: an empty plan) asks
for it `--calls` times, (a) as before the service: plan_extend, MemoryAdmission.grant, PrefixCache.apply,
and (b) through MemoryService.grant(planner), its queue started on a running loop and empty, as between
an engine's steps; then (c) the same with one operator request queued ahead of every call (served inline
first), and (d) what the engine does now for such a step: see that its table holds it and ask for
nothing (RequestMemory.reserve). Prints ns per call, best of 5 rounds. No await happens on any path: no
extra loop tick.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.memory.service import MemoryService  # noqa: E402
from scheduler.cache.prefix_cache import PrefixCache  # noqa: E402
from scheduler.memory.requests import step_needs_plan  # noqa: E402


def _setup():
    cache = PrefixCache(num_blocks=64, block_size=16, host_blocks=0)
    tokens = list(range(1, 41))
    alloc = cache.allocate(cache.match(tokens, 39), 48)  # 3 blocks: room up to token 48
    return cache, alloc


def _best(fn, calls: int) -> float:
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e9)
    return min(rounds)


async def main(calls: int) -> None:
    cache, alloc = _setup()
    service = MemoryService(cache)
    service.start()

    def direct():
        plan = cache.plan_extend(alloc, 45)
        assert cache.admission.grant(plan)
        cache.apply(plan)

    def through():
        assert service.grant(lambda: cache.plan_extend(alloc, 45)).granted

    def behind_one():
        service._queue.put_nowait((lambda: None, "operator", asyncio.get_running_loop().create_future()))
        through()

    def check():
        assert not step_needs_plan(alloc, 45, 16)

    print(f"| path | ns per call (best of 5 x {calls}) |\n| --- | --- |")
    for name, fn in (("plan + grant + apply (before)", direct), ("MemoryService.grant, queue empty", through),
                     ("MemoryService.grant, one request queued ahead", behind_one),
                     ("the engine's step path now: a table that holds the step asks for nothing", check)):
        print(f"| {name} | {_best(fn, calls):.0f} |", flush=True)
    await service.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200000)
    asyncio.run(main(parser.parse_args().calls))
