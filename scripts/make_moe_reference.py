"""Regenerate ``tests/data/moe_reference.json``: transformers' logits and greedy ids for tiny MoE GGUFs.

Each case is a tiny random-weight GGUF written by ``tests/support/tiny_moe_gguf.py`` from a fixed seed (so CI
rewrites the identical file, checked by its sha256, and compares strata against this JSON without torch):

* ``qwen3moe``, ``qwen3moe-q8_0``: transformers' own GGUF loader,
  ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` (+ ``hf_config_overrides``: head_dim,
  moe_intermediate_size), i.e. transformers reads and dequantises the file and runs Qwen3MoeForCausalLM.
* ``gpt-oss``, ``gpt-oss-mxfp4``: transformers' GGUF loader cannot load a llama.cpp gpt-oss file in
  transformers 5.24 (checked with this repository's tiny files):
    1. it crashes on the YaRN keys: ``read_gpt_key`` returns ``field.parts[0]`` (the key's length
       field, not its value), and ``float()`` of that array raises TypeError;
    2. with that patched, no expert tensor is loaded (``mlp.experts.gate_up_proj``, ``down_proj`` and
       both biases are reported MISSING: its GptOssTensorProcessor is registered under ``gpt_oss`` but
       looked up by the file's architecture ``gpt-oss``, and expects ``ffn_*_projs`` names);
    3. ``attn_sinks`` is not loaded (``self_attn.sinks`` MISSING);
    4. ``gpt-oss.attention.sliding_window`` is not read (the config keeps its default 128).
  So these cases are LABELLED "transformers GptOssForCausalLM, weights placed by this script": the
  model code (attention with sinks, sliding windows, YaRN, router, clamped SwiGLU experts) is
  transformers', the config and weights come from the GGUF through the gguf package by the mapping
  below, which is the inverse of llama.cpp's convert_hf_to_gguf.py GptOssModel (it de-interleaves
  gate_up_proj[..., ::2] / [..., 1::2] into ffn_gate_exps / ffn_up_exps and transposes to [E, out, in]).
  ``load_state_dict(strict=True)`` proves every parameter is placed.

Usage: /work/refvenv/bin/python scripts/make_moe_reference.py [--out PATH]   (needs torch, transformers)

JSON: {"cases": [{name, arch, seed, overrides, source, gguf_sha256, prompts: [{prompt_ids, greedy_ids,
prompt_top5 (every position), prompt_rows ({pos: full logits row} at 3 positions), step_top5 (the logits
that chose each greedy id: last prompt position, then each generated one)}]}], versions}.
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
sys.path.insert(0, REPO)
from scripts.hf_reference import greedy_from_model, load_hf_model  # noqa: E402
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf  # noqa: E402

CASES = [
    {"name": "qwen3moe", "arch": "qwen3moe", "seed": 11, "overrides": {}},
    {"name": "qwen3moe-q8_0", "arch": "qwen3moe", "seed": 12, "overrides": {"quant": "Q8_0", "expert_quant": "Q8_0"}},
    # expert_scale 0.6: gate/up pre-activations reach past the SwiGLU clamp (7.0) on many rows
    {"name": "gpt-oss", "arch": "gpt-oss", "seed": 13, "overrides": {"expert_scale": 0.6}},
    {"name": "gpt-oss-mxfp4", "arch": "gpt-oss", "seed": 14, "overrides": {"expert_quant": "MXFP4", "expert_scale": 0.6}},
]
PROMPT_LENS = (13, 41)  # 41 > gpt-oss's sliding window (8); 41 + N_NEW > its YaRN original context (64)
N_NEW = 40
VOCAB_LOW, VOCAB_HIGH = 3, 275  # ordinary tokens of tests/support/tiny_gguf.py's vocabulary


def prompt_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed * 1000 + n).integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist()


def topk(row: np.ndarray, k: int = 5) -> list[list]:
    idx = np.argsort(-row, kind="stable")[:k]
    return [[int(i), round(float(row[i]), 6)] for i in idx]


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def gpt_oss_from_gguf(path: str):
    """transformers' GptOssForCausalLM with config and weights taken from a llama.cpp gpt-oss GGUF."""
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import GptOssConfig, GptOssForCausalLM

    reader = GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    g = lambda key: meta[f"gpt-oss.{key}"]  # noqa: E731
    t = {x.name: np.asarray(dequantize(x.data, x.tensor_type), dtype=np.float32)
         .reshape([int(d) for d in reversed(x.shape.tolist())]) for x in reader.tensors}
    n_layers = int(g("block_count"))
    config = GptOssConfig(
        vocab_size=t["token_embd.weight"].shape[0], hidden_size=int(g("embedding_length")),
        intermediate_size=int(g("expert_feed_forward_length")), num_hidden_layers=n_layers,
        num_attention_heads=int(g("attention.head_count")), num_key_value_heads=int(g("attention.head_count_kv")),
        head_dim=int(g("attention.key_length")), num_local_experts=int(g("expert_count")),
        num_experts_per_tok=int(g("expert_used_count")), sliding_window=int(g("attention.sliding_window")),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(g("context_length")),
        # No "truncate" key exists in GGUF: the default (True) is what transformers' GGUF path would use.
        rope_parameters={"rope_type": "yarn", "rope_theta": float(g("rope.freq_base")),
                         "factor": float(g("rope.scaling.factor")),
                         "original_max_position_embeddings": int(g("rope.scaling.original_context_length"))},
        tie_word_embeddings=False, attention_bias=True, attn_implementation="eager",
    )
    assert config.layer_types == ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"],
          "lm_head.weight": t["output.weight"]}
    for i in range(n_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        sd[h + "input_layernorm.weight"] = t[p + "attn_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = t[p + "post_attention_norm.weight"]
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            sd[h + f"self_attn.{hf}.weight"], sd[h + f"self_attn.{hf}.bias"] = t[p + gg + ".weight"], t[p + gg + ".bias"]
        sd[h + "self_attn.sinks"] = t[p + "attn_sinks.weight"]
        sd[h + "mlp.router.weight"], sd[h + "mlp.router.bias"] = t[p + "ffn_gate_inp.weight"], t[p + "ffn_gate_inp.bias"]
        gate, up = t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"]  # [E, F, d]
        n_exp, n_ff, d = gate.shape
        gate_up = np.empty((n_exp, d, 2 * n_ff), dtype=np.float32)  # HF: x @ gate_up, gate/up interleaved
        gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        bias = np.empty((n_exp, 2 * n_ff), dtype=np.float32)
        bias[:, 0::2], bias[:, 1::2] = t[p + "ffn_gate_exps.bias"], t[p + "ffn_up_exps.bias"]
        sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.gate_up_proj_bias"] = gate_up, bias
        sd[h + "mlp.experts.down_proj"] = t[p + "ffn_down_exps.weight"].transpose(0, 2, 1).copy()  # [E, F, d]
        sd[h + "mlp.experts.down_proj_bias"] = t[p + "ffn_down_exps.bias"]
    model = GptOssForCausalLM(config).to(torch.float32)
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sd.items()}, strict=True)
    return model.eval()


def build_case(case: dict, directory: str) -> dict:
    import torch

    path = os.path.join(directory, f"{case['name']}.gguf")
    write_tiny_moe_gguf(path, case["arch"], seed=case["seed"], **case["overrides"])
    if case["arch"] == "gpt-oss":
        model, source = gpt_oss_from_gguf(path), "transformers GptOssForCausalLM, weights placed by this script"
    else:
        model, source = load_hf_model(path), "transformers from_pretrained(gguf_file=...)"
    prompts = []
    for n in PROMPT_LENS:
        ids = prompt_ids(case["seed"], n)
        greedy = greedy_from_model(model, ids, N_NEW)
        with torch.no_grad():
            logits = model(torch.tensor([ids + greedy]), use_cache=False).logits[0].float().numpy()
        rows = {str(p): [round(float(v), 6) for v in logits[p]] for p in (0, n // 2, n - 1)}
        prompts.append({
            "prompt_ids": ids, "greedy_ids": greedy,
            "prompt_top5": [topk(logits[p]) for p in range(n)],
            "prompt_rows": rows,
            "step_top5": [topk(logits[p]) for p in range(n - 1, n - 1 + N_NEW)],
        })
        assert [int(np.argmax(logits[p])) for p in range(n - 1, n - 1 + N_NEW)] == greedy, "cache != full pass"
    return {**case, "source": source, "gguf_sha256": sha256(path), "prompts": prompts}


def main(argv: list[str] | None = None) -> int:
    import importlib.metadata as md

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "data", "moe_reference.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        cases = [build_case(c, directory) for c in CASES]
    versions = {name: md.version(name) for name in ("torch", "transformers", "gguf")}
    with open(args.out, "w") as f:
        json.dump({"cases": cases, "versions": versions, "n_new": N_NEW}, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
