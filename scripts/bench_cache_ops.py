"""Cost of the conversation cache's bookkeeping per request, on synthetic trees of 1K / 10K / 100K blocks.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_cache_ops.py [--sizes 1000,10000,100000]
        [--requests 2000] [--reference [--max-warmup 50]] [--through-service]

No model and no bytes: a null mover, so only the policy is timed. The device pool holds `size` blocks and
is full: a tree of conversations of 32 blocks (512 tokens) under a shared 2-block system prompt, with host
RAM for a tenth as many blocks. Each request continues a random conversation with 3 new blocks (48 tokens)
and is timed through match + plan_allocate + grant + apply, then release with 16 generated tokens: its
plan parks the least valuable blocks (restoring the parked blocks of a conversation when it is hit) and,
host RAM being full (the warm-up fills it), drops host leaves too. Prints median and p99 per request (ms,
wall clock) and the parts' medians.
`--through-service` sends every plan through the memory admission's coroutine path (MemoryService.grant,
its queue started on a running loop and empty, as between an engine's steps), to time what that adds.
`--reference` times the full scans that chose victims before the eviction index (tests/support/eviction_reference.py)
on the same workload, for comparison.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import scheduler.cache.planner as planner_module  # noqa: E402
from scheduler.cache.block_mover import BlockMoves  # noqa: E402
from scheduler.memory.service import MemoryService  # noqa: E402
from scheduler.cache.prefix_cache import PrefixCache  # noqa: E402

BLOCK = 16
CONVERSATION_BLOCKS = 32
NEW_BLOCKS = 3
GENERATED = 16
HOST_SHARE = 10  # host RAM for a tenth as many blocks as the device pool


class NullMover:
    """Moves nothing and records nothing (the policy alone is timed)."""

    def apply(self, moves: BlockMoves):
        return []

    def save(self, node):
        return True

    def read_disk(self, node):
        return None

    def delete_disk(self, node):
        pass


def build(size: int, seed: int) -> tuple[PrefixCache, list[list[int]]]:
    """A full device pool of `size` blocks: conversations under one system prompt, each released once."""
    rng = random.Random(seed)
    cache = PrefixCache(num_blocks=size, block_size=BLOCK, host_blocks=size // HOST_SHARE, mover=NullMover())
    system = [rng.randrange(1, 50000) for _ in range(2 * BLOCK)]
    conversations = []
    while cache.tiers.num_free_ids("device") >= CONVERSATION_BLOCKS:
        tokens = system + [rng.randrange(1, 50000) for _ in range((CONVERSATION_BLOCKS - 2) * BLOCK)]
        alloc = cache.allocate(cache.match(tokens, len(tokens) - 1), len(tokens))
        cache.release(tokens, len(tokens), alloc)
        conversations.append(tokens)
    return cache, conversations


def one_request(cache: PrefixCache, tokens: list[int], rng: random.Random, service=None) -> dict[str, float]:
    prompt = tokens + [rng.randrange(1, 50000) for _ in range(NEW_BLOCKS * BLOCK)]
    total = len(prompt) + GENERATED
    t0 = time.perf_counter()
    match = cache.match(prompt, len(prompt) - 1)
    t1 = time.perf_counter()
    if service is not None:  # plan + grant + apply in one call of the admission's engine path
        grant = service.grant(lambda: cache.plan_allocate(match, total))
        assert grant.granted, "the bench's pool always has unpinned blocks"
        alloc = grant.allocation
        t2 = t3 = time.perf_counter()
        service.grant(lambda: cache.plan_release(prompt + [7] * GENERATED, total, alloc))
        t4 = time.perf_counter()
        return {"total": t4 - t0, "match": t1 - t0, "plan": t2 - t1, "apply": 0.0, "release": t4 - t3}
    plan = cache.plan_allocate(match, total)
    t2 = time.perf_counter()
    assert plan is not None and cache.admission.grant(plan), "the bench's pool always has unpinned blocks"
    alloc = cache.apply(plan)
    t3 = time.perf_counter()
    cache.release(prompt + [7] * GENERATED, total, alloc)
    t4 = time.perf_counter()
    return {"total": t4 - t0, "match": t1 - t0, "plan": t2 - t1, "apply": t3 - t2, "release": t4 - t3}


def bench(size: int, requests: int, seed: int = 1, max_warmup: int | None = None,
          through_service: bool = False) -> dict[str, float]:
    if through_service is True:  # started on a running loop, as between an engine's steps
        async def on_loop():
            return bench(size, requests, seed, max_warmup, through_service=_started_service)
        return asyncio.run(on_loop())
    cache, conversations = build(size, seed)
    service = through_service(cache) if callable(through_service) else None
    rng = random.Random(seed + 1)
    warmup = 0
    while len(cache.tiers.blocks("host")) < cache.host_blocks and warmup != max_warmup:  # host RAM fills, parked blocks hit
        one_request(cache, rng.choice(conversations), rng)
        warmup += 1
    rows = [one_request(cache, rng.choice(conversations), rng, service) for _ in range(requests)]
    totals = sorted(r["total"] for r in rows)
    out = {"cached_blocks": cache.num_cached, "device": len(cache.tiers.blocks("device")), "host": len(cache.tiers.blocks("host")),
           "median_ms": 1e3 * statistics.median(totals), "p99_ms": 1e3 * totals[int(0.99 * (len(rows) - 1))]}
    for part in ("match", "plan", "apply", "release"):
        out[part + "_ms"] = 1e3 * statistics.median(r[part] for r in rows)
    out["stats"] = {k: cache.stats[k] for k in ("parks", "restores", "dropped_blocks")}
    cache.check_integrity()
    return out


def _started_service(cache: PrefixCache) -> MemoryService:
    service = MemoryService(cache)
    service.start()
    return service


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--reference", action="store_true", help="time the old full scans instead")
    parser.add_argument("--through-service", action="store_true",
                        help="every plan through the memory admission's engine path (MemoryService.grant)")
    parser.add_argument("--max-warmup", type=int, default=None,
                        help="requests before timing at most (default: until host RAM is full)")
    args = parser.parse_args()
    if args.reference:
        import tests.support.eviction_reference as reference
        planner_module.plan_device_room = \
            lambda view, plan, count, exclude: reference.plan_device_room(view, plan, count, {id(b) for b in exclude})
    print("| cached blocks | device / host | per request median (ms) | p99 (ms) | match | plan | apply | release |"
          " parks / restores / drops |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in (int(s) for s in args.sizes.split(",")):
        r = bench(size, args.requests, max_warmup=args.max_warmup, through_service=args.through_service)
        s = r["stats"]
        print(f"| {r['cached_blocks']} | {r['device']} / {r['host']} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | "
              f"{r['match_ms']:.3f} | {r['plan_ms']:.3f} | {r['apply_ms']:.3f} | {r['release_ms']:.3f} | "
              f"{s['parks']} / {s['restores']} / {s['dropped_blocks']} |", flush=True)


if __name__ == "__main__":
    main()
