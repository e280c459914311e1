"""Benchmark of grammar-constrained decoding (engine/grammar.py, llguidance): setup, mask cost, decode speed.

    .venv/bin/python scripts/bench_grammar.py [--model smollm2] [--max-tokens 96] [--repeats 3]

Prints markdown tables:
- setup per vocabulary: building the llguidance tokenizer (once per model) and compiling a JSON schema
  (once per request), for SmolLM2's 49K vocabulary and a 152K Qwen2-style byte-level BPE vocabulary written
  here as a tokenizer-only GGUF (SmolLM2's tokens and merges, plus 100K+ merged tokens, Qwen2's special
  tokens with <tool_call> / </tool_call> as USER_DEFINED, pre-tokenizer "qwen2");
- mask cost per token for a JSON-schema grammar (median and mean us), computed synchronously, driven
  token by token by random logits biased towards JSON punctuation (so replies end) at temperature 1; plus
  what applying the mask costs the sampler (greedy, with vs without);
- decode tok/s on the model through the engine loop (batch 1 and 4, greedy), without and with a grammar
  that keeps the reply going (a JSON object with one string of at least 4000 characters), and the cost of a
  constrained step relative to an unconstrained one, and how long the sampling worker waited in mask() (the
  mask is begun when the step is scheduled, so it is normally ready).
The machine is shared: the load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
from gguf import GGUFReader  # noqa: E402

from engine.grammar import GrammarCompiler, TokenConstraint, json_schema_grammar  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.sampling import Sampler, SamplingParams  # noqa: E402
from engine.sequence import ModelRunner  # noqa: E402
from engine.tokenizer import CONTROL, NORMAL, UNUSED, USER_DEFINED, Tokenizer  # noqa: E402
from scheduler.engine_loop import EngineLoop  # noqa: E402
from scheduler.request import Request  # noqa: E402

SCHEMA = {  # a tool-call-like object: strings, a number, an enum, an array of objects
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "stops": {"type": "array", "maxItems": 3,
                          "items": {"type": "object", "properties": {"at": {"type": "string", "maxLength": 20},
                                                                     "hours": {"type": "number"}},
                                    "required": ["at", "hours"], "additionalProperties": False}},
            },
            "required": ["city", "days", "unit", "stops"], "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
LONG_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}},
               "required": ["story"], "additionalProperties": False}
QWEN_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_USER = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
             "<|repo_name|>", "<|file_sep|>"]
QWEN_NORMAL, QWEN_VOCAB = 151_643, 151_936  # Qwen2.5: normal tokens, then specials, then padding to n_vocab


def write_qwen_like_gguf(path: Path, base: dict, seed: int = 0) -> None:
    """A tokenizer-only GGUF with a 152K Qwen2-style vocabulary grown from ``base`` (GGUF tokenizer fields of
    a byte-level BPE vocabulary): each new token is the merge of a word-start token and a continuation."""
    tokens = [t for t, ty in zip(base["tokenizer.ggml.tokens"], base["tokenizer.ggml.token_type"]) if ty == NORMAL]
    merges = list(base["tokenizer.ggml.merges"])
    have = set(tokens)
    starts = [t for t in tokens[:20_000] if t.startswith("\u0120") and t[1:].isalpha()]
    conts = [t for t in tokens[:6_000] if t.isalpha() and t.islower()]
    rng = np.random.default_rng(seed)
    while len(tokens) < QWEN_NORMAL:
        a, b = starts[rng.integers(len(starts))], conts[rng.integers(len(conts))]
        if a + b not in have:
            have.add(a + b)
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    tokens += QWEN_CONTROL + QWEN_USER
    types = [NORMAL] * QWEN_NORMAL + [CONTROL] * len(QWEN_CONTROL) + [USER_DEFINED] * len(QWEN_USER)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), QWEN_VOCAB)]
    types += [UNUSED] * (QWEN_VOCAB - len(types))
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenizer_fields(path) -> dict:
    return {k: f.contents() for k, f in GGUFReader(str(path), "r").fields.items() if k.startswith("tokenizer.")}


def biased_logits(rng, bias: np.ndarray) -> np.ndarray:
    return (rng.standard_normal(bias.shape[0]) * 2.0 + bias).astype(np.float32)


def punctuation_bias(tokenizer: Tokenizer) -> np.ndarray:
    """+6 on tokens spelling JSON structure (quotes, brackets, commas, digits), so random replies finish."""
    bias = np.zeros(tokenizer.vocab_size, dtype=np.float32)
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_piece(i)
        if piece and len(piece) <= 3 and all(c in b'"{}[],:0123456789 ' for c in piece):
            bias[i] = 6.0
    return bias


def bench_setup(tokenizer: Tokenizer, repeats: int) -> dict:
    builds = []
    for _ in range(repeats):
        compiler = GrammarCompiler(tokenizer)
        started = time.perf_counter()
        compiler.prepare()
        builds.append(time.perf_counter() - started)
    grammar = json_schema_grammar(SCHEMA)
    compiles = []
    for _ in range(20):
        started = time.perf_counter()
        compiler.constraint(grammar)
        compiles.append(time.perf_counter() - started)
    return {"compiler": compiler, "build_ms": statistics.median(builds) * 1e3,
            "compile_ms": statistics.median(compiles) * 1e3}


def bench_mask(compiler: GrammarCompiler, replies: int) -> dict:
    """Per-token mask cost over ``replies`` random constrained replies, and the sampler's cost of applying it."""
    tokenizer = compiler.tokenizer
    bias, rng, grammar = punctuation_bias(tokenizer), np.random.default_rng(0), json_schema_grammar(SCHEMA)
    times, lengths, applied, plain = [], [], [], []
    for r in range(replies):
        constraint = compiler.constraint(grammar)
        sampler, greedy = Sampler(SamplingParams(temperature=1.0, seed=r)), Sampler(SamplingParams(temperature=0))
        for n in range(1, 2000):
            started = time.perf_counter()
            mask = constraint.mask()  # no begin_mask: computed here, synchronously
            times.append(time.perf_counter() - started)
            logits = biased_logits(rng, bias)
            started = time.perf_counter()
            greedy.sample(logits, mask)
            applied.append(time.perf_counter() - started)
            started = time.perf_counter()
            greedy.sample(logits)
            plain.append(time.perf_counter() - started)
            token = sampler.sample(logits, mask)
            if token in tokenizer.eos_ids:
                break
            constraint.accept(token)
            if constraint.is_finished:
                break
        lengths.append(n)
    us = np.array(times) * 1e6
    return {"median_us": float(np.median(us)), "mean_us": float(us.mean()), "p99_us": float(np.percentile(us, 99)),
            "tokens": int(us.size), "reply_tokens": statistics.median(lengths),
            "apply_us": (statistics.median(applied) - statistics.median(plain)) * 1e6}


async def decode_run(loaded, compiler: GrammarCompiler | None, batch: int, max_tokens: int,
                     timings: dict[str, list[float]] | None = None) -> float:
    """Aggregate decode tok/s of ``batch`` greedy streams (tokens after each first / span of the decode);
    with a grammar, appends to ``timings`` how long each mask() call blocked the sampling worker ("wait")
    and how long each mask took to compute on the grammar pool ("compute")."""
    loop = EngineLoop(ModelRunner(loaded.model, batch * 64, 16), loaded.tokenizer, num_slots=batch,
                      prefill_chunk=512, max_queue=16)
    loop.start()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    grammar = json_schema_grammar(LONG_SCHEMA) if compiler else None
    topics = ["the sea", "a city at night", "mountains", "an old library"]

    async def stream(i: int):
        text = (f"<|im_start|>user\nWrite a long story about {topics[i % 4]}, as JSON.<|im_end|>\n"
                "<|im_start|>assistant\n")
        prompt = loaded.tokenizer.encode(text, add_special=True)
        request = Request(f"g{i}", prompt, params, constraint=compiler.constraint(grammar) if compiler else None)
        first, last, tokens = None, None, 0
        async for delta in loop.submit(request):
            if delta.token_ids:
                tokens += len(delta.token_ids)
                last = time.perf_counter()
                first = first or last
            if delta.finish_reason is not None:
                assert delta.finish_reason == "length", delta.finish_reason
        return first, last, tokens

    real = {"mask": TokenConstraint.mask, "_compute": TokenConstraint._compute}

    def timed(name: str, key: str):
        def wrapper(self):
            started = time.perf_counter()
            try:
                return real[name](self)
            finally:
                timings[key].append(time.perf_counter() - started)
        return wrapper

    if timings is not None:
        TokenConstraint.mask, TokenConstraint._compute = timed("mask", "wait"), timed("_compute", "compute")
    try:
        results = await asyncio.gather(*[stream(i) for i in range(batch)])
    finally:
        TokenConstraint.mask, TokenConstraint._compute = real["mask"], real["_compute"]
    await loop.shutdown(1)
    span = max(last for _, last, _ in results) - min(first for first, _, _ in results)
    return sum(t - 1 for *_, t in results) / span


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replies", type=int, default=20, help="random constrained replies for the mask cost")
    args = parser.parse_args()
    path = resolve_model(args.model)
    base = tokenizer_fields(path)
    vocabularies = [(f"{path.name} ({len(base['tokenizer.ggml.tokens'])})", Tokenizer.from_gguf_fields(base))]
    with tempfile.TemporaryDirectory() as tmp:
        qwen_path = Path(tmp) / "qwen-like-152k.gguf"
        write_qwen_like_gguf(qwen_path, base)
        vocabularies.append((f"Qwen2-style BPE ({QWEN_VOCAB})", Tokenizer.from_gguf_path(str(qwen_path))))
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
    print("\n| vocabulary | build llguidance tokenizer (ms, once per model) | compile JSON schema (ms, per request) | "
          "mask median (us) | mask mean (us) | mask p99 (us) | tokens (median reply) | "
          "sampler: applying the mask (us) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    compilers = {}
    for name, tokenizer in vocabularies:
        setup = bench_setup(tokenizer, args.repeats)
        compilers[name] = setup["compiler"]
        mask = bench_mask(setup["compiler"], args.replies)
        print(f"| {name} | {setup['build_ms']:.0f} | {setup['compile_ms']:.2f} | {mask['median_us']:.0f} | "
              f"{mask['mean_us']:.0f} | {mask['p99_us']:.0f} | {mask['tokens']} ({mask['reply_tokens']:.0f}) | "
              f"{mask['apply_us']:.0f} |", flush=True)

    loaded = open_model(args.model, max_positions=1024)
    compiler = compilers[vocabularies[0][0]]
    print(f"\ndecode through the engine loop, greedy, {args.max_tokens} tokens per stream, median of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("\n| batch | tok/s without grammar | tok/s with grammar | constrained step costs (median of pairs) | "
          "mask compute on the pool, median (us) | mask() wait on the sampling worker, median / p99 (us) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in (1, 4):
        plain, constrained, timings = [], [], {"wait": [], "compute": []}
        for _ in range(args.repeats):  # in pairs, so a busy neighbour hits both alike
            plain.append(asyncio.run(decode_run(loaded, None, batch, args.max_tokens)))
            constrained.append(asyncio.run(decode_run(loaded, compiler, batch, args.max_tokens, timings)))
        cost = statistics.median(p / c - 1 for p, c in zip(plain, constrained))
        wait, compute = np.array(timings["wait"]) * 1e6, np.array(timings["compute"]) * 1e6
        print(f"| {batch} | {statistics.median(plain):.1f} | {statistics.median(constrained):.1f} | "
              f"{cost * 100:+.1f}% | {np.median(compute):.0f} | {np.median(wait):.0f} / {np.percentile(wait, 99):.0f} |",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
