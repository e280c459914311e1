"""The engine's schedule for N concurrent streams, without HTTP: steps taken and the step of each first token.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_step_schedule.py [--model smollm2] [--streams 4]
                                                                           [--max-tokens 64] [--threads 2]
                                                                           [--prompt-tokens 0]
                                                                           [--prefill-chunk 512]
                                                                           [--prefill-step-tokens 2048]

The step counts do not depend on the machine's load (wall times do), so two checkouts can be compared on a
shared machine: run it from each checkout's root. An admission change that delayed requests or added
steps shows here as more steps or later first-token steps. --prompt-tokens N pads each stream's prompt to about N tokens (agents'
prompts), which shows how the prompts share steps (scheduler/step_plan.py).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout it is run from, not this file's

from engine.cpu_threads import limit_threads  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.sequence import ModelRunner  # noqa: E402
from scheduler.engine_loop import EngineLoop  # noqa: E402
from scheduler.request import Request  # noqa: E402

TOPICS = ["the sea", "mountains", "winter", "trains", "a city at night", "an old library", "the desert", "a forest"]


async def run(loaded, args) -> dict:
    tokenizer, streams, max_tokens = loaded.tokenizer, args.streams, args.max_tokens
    loop = EngineLoop(ModelRunner(loaded.model, 8 * 128, 16, host_blocks=0), tokenizer, num_slots=8,
                      prefill_chunk=args.prefill_chunk, prefill_step_tokens=args.prefill_step_tokens, max_queue=64)
    loop.start()
    notes = [" ".join(TOPICS[(i + j) % len(TOPICS)] for j in range(args.prompt_tokens // 3)) for i in range(streams)]
    prompts = [tokenizer.encode(f"{notes[i]} Write a long story about {t}.", add_special=True)
               for i, t in enumerate(TOPICS[:streams])]
    started, firsts = time.perf_counter(), []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> int:
        count = 0
        async for delta in loop.submit(Request(f"r{i}", prompt, params)):
            if delta.token_ids and not count:
                firsts.append(loop.num_steps)
            count += len(delta.token_ids)
        return count

    counts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - started
    await loop.shutdown(1)
    return {"steps": loop.num_steps, "first_token_steps": sorted(firsts), "tokens": counts, "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="pad each prompt to about this many tokens")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--prefill-step-tokens", type=int, default=2048)
    args = parser.parse_args()
    limit_threads(args.threads)
    loaded = open_model(args.model, max_positions=2048)
    print(asyncio.run(run(loaded, args)))


if __name__ == "__main__":
    main()
