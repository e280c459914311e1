"""Greedy ids of the integer prefill paths against the float path, on the reference prompts.

    .venv/bin/python scripts/check_prefill_greedy.py [--models smollm2,gemma3] [--n-new 48] [--chunk 512]

For every prompt of tests/data/<model>_reference.json, greedy decoding of --n-new ids after prefilling the
prompt in chunks of --chunk tokens, with --cpu-weights quantized (prefill products on int16 activations,
cpu/int8_gemm.py), quantized-int8act (int8) and quantized-f32act (the float path: float32 activations, tiles
dequantised for BLAS). Prints per prompt and mode the first step whose id differs from the float path's
("-": none), and a summary line per model.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.cpu_threads import limit_threads  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.sequence import ModelRunner, Sequence  # noqa: E402

MODES = ("quantized-f32act", "quantized", "quantized-int8act")


def greedy(runner: ModelRunner, prompt: list[int], n_new: int, chunk: int) -> list[int]:
    seq = Sequence(list(prompt))
    runner.ensure_blocks(seq, len(prompt) + n_new)
    out = []
    try:
        while seq.num_pending:
            logits = runner.step([(seq, min(chunk, seq.num_pending))])
        for _ in range(n_new):
            out.append(int(np.argmax(logits[-1])))
            seq.token_ids.append(out[-1])
            logits = runner.step([(seq, 1)])
    finally:
        runner.release(seq)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--n-new", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with limit_threads(args.threads):
        for model in args.models.split(","):
            prompts = json.loads((ROOT / f"tests/data/{model}_reference.json").read_text())["prompts"]
            ids = {}
            for mode in MODES:
                loaded = open_model(model, max_positions=4096, cpu_weights=mode)
                loaded.model.backend.prepare_decode(loaded.model)
                runner = ModelRunner(loaded.model, num_blocks=4096 // 16, block_size=16, kv_type="f16")
                ids[mode] = [greedy(runner, p["prompt_ids"], args.n_new, args.chunk) for p in prompts]
            same = {m: 0 for m in MODES[1:]}
            for i, p in enumerate(prompts):
                cells = []
                for mode in MODES[1:]:
                    diff = [k for k, (a, b) in enumerate(zip(ids[mode][i], ids[MODES[0]][i])) if a != b]
                    same[mode] += not diff
                    cells.append(f"{mode}: {diff[0] if diff else '-'}")
                print(f"{model} {p['name']} ({len(p['prompt_ids'])} tokens): first divergence " + ", ".join(cells))
            print(f"{model}: " + ", ".join(f"{m} equal to the float path on {n}/{len(prompts)} prompts"
                                           for m, n in same.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
