"""Write tiny random-weight GGUF files for tests.

``write_tiny_gguf`` produces a small but structurally faithful GGUF for the
``llama``, ``qwen2``, ``qwen3`` and ``gemma3`` architectures: the tensor names
and metadata keys are the ones llama.cpp's ``convert_hf_to_gguf.py`` writes for
that architecture, plus a tiny byte-level GPT-2 style BPE tokenizer (so tools
that insist on a tokenizer, e.g. transformers, can load the file).

Conventions worth knowing when comparing against a reference:

* numpy arrays are ``[out_features, in_features]``; GGUFWriter stores the
  dims reversed (``ne = [in, out]``) exactly like the converter does.
* ``llama`` q/k weights are stored as-is; transformers un-permutes them on load
  (llama.cpp's llama arch uses the "normal" adjacent-pair RoPE), while qwen2,
  qwen3 and gemma3 use NEOX (half-split) RoPE with no permutation.
* gemma3 norm weights are stored already ``+1`` (as the converter does), so
  the runtime computes ``x_normed * w`` for every arch.
* 1-D tensors (norms, biases) are always F32; ``quant`` applies to the 2-D
  matmul weights (attn q/k/v/output, ffn gate/up/down, output.weight) and
  ``embd_quant`` to ``token_embd.weight``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.quants import quantize

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# Types gguf 0.19's numpy ``quantize`` implements (K-quants and IQ* raise
# NotImplementedError there). Block size 32 for all except F32/F16/BF16.
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Merges over the GPT-2 byte alphabet ("Ġ" is the space byte).
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
    ("Ġt", "he"), ("r", "e"), ("Ġ", "s"), ("a", "t"), ("e", "n"), ("o", "r"),
    ("Ġ", "w"), ("i", "s"), ("Ġ", "c"), ("e", "s"),
]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' "
    "+ message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DEFAULTS = {
    #          layers  ctx   rope_base   eps    tied
    "llama": (2, 256, 10000.0, 1e-5, False),
    "qwen2": (2, 256, 1000000.0, 1e-6, True),
    "qwen3": (3, 256, 1000000.0, 1e-6, True),
    "gemma3": (6, 256, 1000000.0, 1e-6, True),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Return (tokens, token_types, merges) of the tiny byte-level tokenizer.

    Ids 0..2 are the control tokens ``<|endoftext|>``, ``<|im_start|>``,
    ``<|im_end|>`` (same ids as SmolLM2), ids 3..258 are the 256 bytes in byte
    order, then one token per merge.
    """
    b2u = bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [b2u[b] for b in range(256)]
    tokens += [a + b for a, b in MERGES]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    merges = [f"{a} {b}" for a, b in MERGES]
    assert len(set(tokens)) == len(tokens)
    return tokens, types, merges


def encode_tensor(arr: np.ndarray, qname: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """Quantise ``arr`` to ``qname``; returns (data, raw_dtype for add_tensor)."""
    if qname not in SUPPORTED_QUANTS:
        raise ValueError(f"quant {qname!r} not supported by gguf.quants.quantize; "
                         f"use one of {SUPPORTED_QUANTS}")
    if qname == "F32":
        return arr.astype(np.float32), None
    if qname == "F16":
        return arr.astype(np.float16), None
    qt = GGMLQuantizationType[qname]
    return quantize(arr.astype(np.float32), qt), qt


def add_tiny_tokenizer(w, tokens, types, merges, *, eos_id: int = 2, add_bos: bool = False) -> None:
    """The tiny gpt2-BPE tokenizer's metadata (tiny_vocab), shared by every tiny GGUF writer in tests/."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos_id)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)


def add_extra_metadata(w, extra: dict) -> None:
    """``extra_metadata`` {key: value}: each value with the GGUF type of its Python type."""
    for k, v in extra.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            raise TypeError(f"extra_metadata {k!r}: unsupported value type {type(v)}")


def finish_tiny_gguf(w, tokens, types, merges, tensors: dict, chat_template: str | None = CHATML_TEMPLATE,
                     **tokenizer_options) -> None:
    """What every tiny writer ends with, in the converter's order: the tokenizer (``tokenizer_options`` for
    add_tiny_tokenizer), the chat template (None: none), the quantization version, then ``tensors``
    ({name: (data, raw_dtype or None)}); writes the file and closes it."""
    add_tiny_tokenizer(w, tokens, types, merges, **tokenizer_options)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gguf(path, arch: str, seed: int = 0, **overrides) -> dict:
    """Write a tiny random-weight GGUF for ``arch`` to ``path``.

    Overrides (all optional): ``n_embd`` (64), ``n_layer`` (llama/qwen2 2,
    qwen3 3, gemma3 6 so layer 5 is global under llama.cpp's 5:1 pattern),
    ``n_head`` (4), ``n_head_kv`` (2), ``head_dim`` (16), ``n_ff`` (128),
    ``n_ctx`` (256), ``rope_base``, ``rms_eps``, ``sliding_window`` (gemma3,
    6), ``tied`` (omit ``output.weight``; default True except llama),
    ``quant`` ('F32'; any of ``SUPPORTED_QUANTS``) for 2-D matmul weights,
    ``embd_quant`` ('F32') for ``token_embd.weight``, ``weight_scale`` (0.2,
    std of matmul weights), ``embd_scale`` (0.1; gemma3 0.05 because its
    embeddings are multiplied by sqrt(n_embd) and tied, which otherwise makes
    greedy output repeat one token), ``norm_scale`` (0.1, spread of norm
    weights around 1),
    ``name``, ``chat_template`` (ChatML; None to omit), ``add_bos`` (False),
    ``extra_metadata`` ({key: value} added with GGUFWriter.add_key_value
    inference: int -> uint32, float -> float32, bool, str), ``split_max_tensors``
    (0; N writes a split model ``<stem>-00001-of-0000K.gguf`` .. of at most N tensors
    a part, as llama-gguf-split does, instead of ``path``).

    Returns a dict with the config: arch, path, vocab_size, n_embd, n_layer,
    n_head, n_head_kv, head_dim, n_ff, n_ctx, rope_base, rms_eps,
    sliding_window (gemma3 else None), tied, quant, embd_quant, bos_id,
    eos_id, tokens, and ``tensors`` ({name: float32 numpy array as stored
    before quantisation, i.e. the exact weights for F32 files}).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    d_layers, d_ctx, d_base, d_eps, d_tied = _DEFAULTS[arch]
    o = dict(overrides)
    n_embd = o.pop("n_embd", 64)
    n_layer = o.pop("n_layer", d_layers)
    n_head = o.pop("n_head", 4)
    n_head_kv = o.pop("n_head_kv", 2)
    head_dim = o.pop("head_dim", 16)
    n_ff = o.pop("n_ff", 128)
    n_ctx = o.pop("n_ctx", d_ctx)
    rope_base = float(o.pop("rope_base", d_base))
    rms_eps = float(o.pop("rms_eps", d_eps))
    sliding_window = o.pop("sliding_window", 6) if arch == "gemma3" else None
    tied = bool(o.pop("tied", d_tied))
    quant = o.pop("quant", "F32")
    embd_quant = o.pop("embd_quant", "F32")
    wscale = o.pop("weight_scale", 0.2)
    escale = o.pop("embd_scale", 0.05 if arch == "gemma3" else 0.1)
    nscale = o.pop("norm_scale", 0.1)
    name = o.pop("name", f"tiny-{arch}")
    chat_template = o.pop("chat_template", CHATML_TEMPLATE)
    add_bos = bool(o.pop("add_bos", False))
    extra = o.pop("extra_metadata", {})
    split_max_tensors = int(o.pop("split_max_tensors", 0))
    if o:
        raise TypeError(f"unknown overrides: {sorted(o)}")
    for q in (quant, embd_quant):
        if q not in SUPPORTED_QUANTS:
            raise ValueError(f"quant {q!r} unsupported; use one of {SUPPORTED_QUANTS}")

    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = wscale) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        # "HF" weight is 1 + eps for llama-likes; gemma3 HF weight is eps and
        # the converter adds 1, so the stored value is the same shape either way.
        return (1.0 + rng.standard_normal(n) * nscale).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"token_embd.weight": mat(vocab, n_embd, escale)}
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(n_embd)
        tensors[p + "attn_q.weight"] = mat(q_dim, n_embd)
        tensors[p + "attn_k.weight"] = mat(kv_dim, n_embd)
        tensors[p + "attn_v.weight"] = mat(kv_dim, n_embd)
        if arch == "qwen2":
            tensors[p + "attn_q.bias"] = mat(1, q_dim, 0.1)[0]
            tensors[p + "attn_k.bias"] = mat(1, kv_dim, 0.1)[0]
            tensors[p + "attn_v.bias"] = mat(1, kv_dim, 0.1)[0]
        if arch in ("qwen3", "gemma3"):
            tensors[p + "attn_q_norm.weight"] = norm(head_dim)
            tensors[p + "attn_k_norm.weight"] = norm(head_dim)
        tensors[p + "attn_output.weight"] = mat(n_embd, q_dim)
        if arch == "gemma3":
            tensors[p + "post_attention_norm.weight"] = norm(n_embd)
        tensors[p + "ffn_norm.weight"] = norm(n_embd)
        tensors[p + "ffn_gate.weight"] = mat(n_ff, n_embd)
        tensors[p + "ffn_up.weight"] = mat(n_ff, n_embd)
        tensors[p + "ffn_down.weight"] = mat(n_embd, n_ff)
        if arch == "gemma3":
            tensors[p + "post_ffw_norm.weight"] = norm(n_embd)
    tensors["output_norm.weight"] = norm(n_embd)
    if not tied:
        tensors["output.weight"] = mat(vocab, n_embd)

    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_type("model")
    w.add_name(name)
    # --- hparams, in the converter's order (TextModel + per-arch extras) ---
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(rms_eps)
    if arch in ("qwen3", "gemma3"):  # HF config has an explicit head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
    if arch == "llama":
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(head_dim)
    ftype = "ALL_F32" if quant == "F32" else f"MOSTLY_{quant}"
    w.add_file_type(int(LlamaFileType[ftype]))
    add_extra_metadata(w, extra)

    def qname(tname: str, arr: np.ndarray) -> str:
        is_matmul = arr.ndim == 2 and tname != "token_embd.weight"
        return quant if is_matmul else (embd_quant if arr.ndim == 2 else "F32")
    # tokenizer: gpt2 BPE, like SmolLM2/Qwen
    finish_tiny_gguf(w, tokens, types, merges, {t: encode_tensor(a, qname(t, a)) for t, a in tensors.items()},
                     chat_template, add_bos=add_bos)

    return {
        "arch": arch, "path": str(Path(path)), "vocab_size": vocab,
        "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head,
        "n_head_kv": n_head_kv, "head_dim": head_dim, "n_ff": n_ff,
        "n_ctx": n_ctx, "rope_base": rope_base, "rms_eps": rms_eps,
        "sliding_window": sliding_window, "tied": tied, "quant": quant,
        "embd_quant": embd_quant, "bos_id": 1, "eos_id": 2,
        "tokens": tokens, "tensors": tensors,
    }
