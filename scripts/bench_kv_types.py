"""--kv-type: accuracy of f16 and int8 K/V against f32 K/V on the reference prompts, and how many
conversations of a given length stay resident in a pool of a given size, per type.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_kv_types.py [--models smollm2,gemma3] [--tokens 48]
        [--pool-mib 256] [--context 4096] [--memory-only] [--speed]

Accuracy: for every prompt of tests/data/<model>_reference.json (quantised weights, the default), the f32-K/V
run decodes `--tokens` greedy ids; each other type is then fed the same ids (teacher forcing), so every step
compares logits on the same context. `first divergence` is the first step whose argmax differs (where free
greedy decoding would first go another way; "-" = none in --tokens), `top-5 err` the largest
|logit - logit(f32 K/V)| over the f32 run's top-5 ids at every step. `f32 top-2 gap`: how close the f32 run's best two logits were at that step (a near-tie flips on any
perturbation). `int8/block` simulates one scale per
block, head and K/V instead of per token (the block re-quantised as it fills, as a per-block store must).
Memory: bytes per token from engine/kv.KVLayout, blocks of 16 tokens in the pool, whole conversations.
--speed (instead of the accuracy table): SmolLM2 prefill of 1024 tokens and decode at that context, per type,
in CPU seconds of the calling thread (wall time on a shared machine measures the neighbours), two rounds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.gguf_file import GGUFFile  # noqa: E402
from engine.kv import BLOCK_SIZE, KV_TYPES, blocks_needed, layout_for  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.units import MIB  # noqa: E402
from tests.support.reference_helpers import compare_to_reference, forced_logits, greedy_with_logits  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
MODELS = {"smollm2": ("smollm2", "smollm2_reference.json", 64), "gemma3": ("gemma3-270m", "gemma3_reference.json", 128)}
_QMAX = np.float32(127)


def per_block_store(backend, block_size: int):
    """store_kv on an f32 pool that keeps every touched block fake-quantised with one scale per block, head
    and K/V (rows not written yet are zeros in a fresh pool, so they do not move the block's max)."""
    store = type(backend).store_kv

    def store_kv(pool, layer, k, v, batch):
        store(backend, pool, layer, k, v, batch)
        for block in np.unique(batch.slot_mapping // block_size):
            for arr in (pool.k[layer], pool.v[layer]):
                rows = arr[:, block * block_size : (block + 1) * block_size, :]  # [KVH, B, hd] view
                amax = np.abs(rows).max(axis=(1, 2), keepdims=True)
                inv = np.where(amax > 0, _QMAX / np.maximum(amax, np.float32(1e-30)), np.float32(0))
                rows[...] = np.rint(rows * inv) * (amax / _QMAX)

    return store_kv


def accuracy_rows(name: str, n_tokens: int) -> list[dict]:
    model_name, reference_file, chunk = MODELS[name]
    model = open_model(str(resolve_model(model_name)), max_positions=2048).model
    out = []
    for prompt in json.loads((DATA / reference_file).read_text())["prompts"]:
        ids, rows_f32 = greedy_with_logits(model, prompt["prompt_ids"], n_tokens, chunk=chunk, kv_type="f32")
        rows_f32 = np.array(rows_f32)
        runs = {t: forced_logits(model, prompt["prompt_ids"], ids, chunk=chunk, kv_type=t) for t in ("f16", "int8")}
        model.backend.store_kv = per_block_store(model.backend, BLOCK_SIZE)  # instance attribute: this run only
        try:
            runs["int8/block"] = forced_logits(model, prompt["prompt_ids"], ids, chunk=chunk, kv_type="f32")
        finally:
            del model.backend.store_kv
        for kv_type, rows in runs.items():
            first, err, gap = compare_to_reference(rows, rows_f32)
            out.append({"model": name, "prompt": prompt["name"], "prompt_tokens": len(prompt["prompt_ids"]),
                        "kv_type": kv_type, "first_divergence": first, "top5_err": err, "gap": gap})
            print(f"  {name} {prompt['name']} {kv_type}: first divergence {first} (f32 top-2 gap {gap}), "
                  f"top-5 err {err:.4f}", flush=True)
    return out


def speed_rows(context: int = 1024, decode_steps: int = 16) -> list[str]:
    import time

    from engine.sequence import ModelRunner, Sequence

    model = open_model(str(resolve_model("smollm2"))).model
    prompt = np.random.default_rng(0).integers(100, 20000, context).tolist()
    rows = []
    for kv_type in [*KV_TYPES] * 2:
        runner = ModelRunner(model, blocks_needed(context + decode_steps, BLOCK_SIZE) + 1, BLOCK_SIZE, kv_type=kv_type)
        seq = Sequence(list(prompt))
        runner.ensure_blocks(seq, context + decode_steps)
        started = time.thread_time()
        while seq.num_pending:
            runner.step([(seq, min(256, seq.num_pending))])
        prefill_s, started = time.thread_time() - started, time.thread_time()
        for _ in range(decode_steps):
            seq.token_ids.append(5)
            runner.step([(seq, 1)])
        decode_ms = 1e3 * (time.thread_time() - started) / decode_steps
        rows.append(f"| {kv_type} | {prefill_s:.1f} | {decode_ms:.1f} |")
        print(f"  {rows[-1]}", flush=True)
    return rows


def memory_rows(name: str, pool_mib: int, context: int) -> list[dict]:
    from engine.config import config_from_gguf

    gguf = GGUFFile(resolve_model(MODELS[name][0]))
    config = config_from_gguf(gguf.fields, vocab_size=1)
    out = []
    for kv_type in KV_TYPES:
        layout = layout_for(config, 1, BLOCK_SIZE, kv_type)
        blocks = pool_mib * MIB // layout.bytes_per_block
        out.append({"model": name, "kv_type": kv_type, "bytes_per_token": layout.bytes_per_token,
                    "blocks": blocks, "conversations": blocks // blocks_needed(context, BLOCK_SIZE)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--speed", action="store_true")
    args = parser.parse_args()
    if args.speed:
        rows = speed_rows()
        print("| K/V type | prefill 1024 tokens (CPU s) | decode at 1024 context (CPU ms / token) |\n| --- | --- | --- |")
        print("\n".join(rows))
        return 0
    names = [m for m in args.models.split(",") if m]
    print(f"| model | K/V type | bytes per token | blocks in {args.pool_mib} MiB | "
          f"{args.context}-token conversations resident |\n| --- | --- | --- | --- | --- |")
    for name in names:
        for r in memory_rows(name, args.pool_mib, args.context):
            print(f"| {name} | {r['kv_type']} | {r['bytes_per_token']} | {r['blocks']} | {r['conversations']} |")
    if args.memory_only:
        return 0
    rows = [r for name in names for r in accuracy_rows(name, args.tokens)]
    print(f"\n| model | prompt (tokens) | K/V type | first divergence in {args.tokens} (f32 top-2 gap there) | "
          "top-5 err |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        first = "-" if r["first_divergence"] is None else f"{r['first_divergence']} ({r['gap']:.3f})"
        print(f"| {r['model']} | {r['prompt']} ({r['prompt_tokens']}) | {r['kv_type']} | {first} | {r['top5_err']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
