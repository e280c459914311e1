"""Write tests/data/lfm2_tiny_reference.json: transformers on the seeded tiny lfm2 GGUF.

    /work/refvenv/bin/python scripts/make_lfm2_reference.py [--out tests/data/lfm2_tiny_reference.json]

The GGUF comes from tests/support/tiny_lfm2.write_tiny_lfm2 with the seed and arguments recorded in the JSON,
so CI (no torch) regenerates the same file and compares strata's numpy engine with what transformers'
own GGUF loader and Lfm2ForCausalLM computed: for each prompt, the greedy ids (transformers' cached
decode, i.e. its conv-state cache) and the logits of every position of prompt + greedy ids (one full
forward pass), rounded to 6 decimals. Also the digest of the tensor data, so a changed writer is caught.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, REPO)
from hf_reference import hf_greedy, hf_logits  # noqa: E402
from tests.support.tiny_lfm2 import write_tiny_lfm2  # noqa: E402

GGUF_ARGS = {"seed": 16, "pattern": "ccacacca", "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 128,
             "conv_l": 3, "n_ctx": 512}
PROMPT_LENGTHS = (21, 37)
N_GREEDY = 36


def tensor_digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "lfm2_tiny_reference.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny-lfm2.gguf")
        info = write_tiny_lfm2(path, **GGUF_ARGS)
        rng = np.random.default_rng(GGUF_ARGS["seed"])
        prompts = []
        for n in PROMPT_LENGTHS:
            ids = rng.integers(3, info["vocab_size"], size=n).tolist()
            greedy = hf_greedy(path, ids, N_GREEDY)
            logits = hf_logits(path, ids + greedy)
            prompts.append({"prompt_ids": ids, "greedy_ids": greedy,
                            "logits": np.round(logits.astype(np.float64), 6).tolist()})
    out = {"gguf_args": GGUF_ARGS, "tensor_sha256": tensor_digest(info["tensors"]), "prompts": prompts,
           "note": "logits[i] predicts token i + 1 of prompt_ids + greedy_ids"}
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {args.out} ({os.path.getsize(args.out) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
