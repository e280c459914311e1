"""Reference logits / greedy generation from Hugging Face transformers.

Used by ``scripts/make_reference.py`` and by tests that compare strata's
numpy engine against transformers on a GGUF file (real or tiny random).
transformers and torch are optional dev dependencies: import this module only
where they are installed (tests should ``pytest.importorskip("transformers")``).

transformers' GGUF loader dequantises every tensor to float32 and builds the
HF model from the GGUF metadata. Two of its metadata mappings do not follow
llama.cpp for small/unusual shapes, so ``hf_config_overrides`` patches them:

* qwen3: ``{arch}.attention.key_length`` is not mapped to ``head_dim``, so the
  Qwen3Config default (128) is used. Fixed by passing ``head_dim``.
* gemma3: ``query_pre_attn_scalar`` is not stored in GGUF and defaults to 256,
  while llama.cpp scales attention by ``1/sqrt(key_length)`` (all sizes but
  27B). Fixed by passing ``query_pre_attn_scalar=key_length``.
* qwen3moe: ``{arch}.expert_feed_forward_length`` is not mapped to
  ``moe_intermediate_size`` (the Qwen3MoeConfig default 768 is used, which
  happens to be Qwen3-30B-A3B's). Fixed by passing it.
* lfm2: the RMS epsilon is mapped to ``rms_norm_eps`` while Lfm2Config reads
  ``norm_eps`` (default 1e-5). Fixed by passing ``norm_eps``.

(gpt-oss is not loadable through this path in transformers 5.24; see
``scripts/make_moe_reference.py``.)

The first two are no-ops for real checkpoints whose head_dim is 128 (qwen3) / 256
(gemma3 1B-12B), so the overrides are always applied.
"""

from __future__ import annotations

import functools
import inspect
import os

import numpy as np


def _gguf_meta(gguf_path: str) -> dict:
    """Read the few scalar GGUF metadata values that matter here."""
    from gguf import GGUFReader

    r = GGUFReader(gguf_path)
    arch = r.fields["general.architecture"].contents()
    out = {"arch": arch}
    for key in ("attention.key_length", "attention.head_count", "embedding_length",
                "expert_feed_forward_length", "attention.layer_norm_rms_epsilon"):
        f = r.fields.get(f"{arch}.{key}")
        if f is not None:
            out[key] = f.contents()
    return out


def hf_config_overrides(gguf_path: str) -> dict:
    """Config kwargs that make transformers' GGUF model match llama.cpp.

    Returns a (possibly empty) dict to pass to ``from_pretrained``.
    """
    meta = _gguf_meta(gguf_path)
    arch, kl = meta["arch"], meta.get("attention.key_length")
    over: dict = {}
    if arch in ("qwen3", "qwen3moe") and kl is not None:
        over["head_dim"] = int(kl)
    if arch == "gemma3" and kl is not None:
        over["query_pre_attn_scalar"] = int(kl)
    if arch == "qwen3moe" and meta.get("expert_feed_forward_length") is not None:
        over["moe_intermediate_size"] = int(meta["expert_feed_forward_length"])
    eps = meta.get("attention.layer_norm_rms_epsilon")
    if arch == "lfm2" and eps is not None:  # mapped to rms_norm_eps, but Lfm2Config reads norm_eps
        over["norm_eps"] = float(eps)
    return over


@functools.lru_cache(maxsize=4)
def _load_model(gguf_path: str, stamp: tuple):
    """Load (and cache per path + mtime/size stamp) the float32 CPU model."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dirname, basename = os.path.split(os.path.abspath(gguf_path))
    # transformers 5 renamed torch_dtype -> dtype (4.x only knows torch_dtype).
    dkey = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        dirname, gguf_file=basename, **{dkey: torch.float32},
        **hf_config_overrides(gguf_path))
    model.eval()
    return model


def load_hf_model(gguf_path: str):
    """Return the cached transformers model for ``gguf_path`` (float32, CPU, eval)."""
    p = os.path.abspath(str(gguf_path))
    st = os.stat(p)
    return _load_model(p, (st.st_mtime_ns, st.st_size, st.st_ino))


def hf_logits(gguf_path, ids: list[int]) -> np.ndarray:
    """Full-sequence logits ``[T, vocab]`` (float32) for token ``ids``.

    One forward pass, no BOS is added (pass it in ``ids`` if wanted).
    """
    import torch

    model = load_hf_model(gguf_path)
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy().astype(np.float32)


def hf_greedy(gguf_path, ids: list[int], n: int) -> list[int]:
    """Greedy-decode exactly ``n`` new tokens after ``ids`` (EOS does not stop).

    Plain argmax over the raw logits at every step (no logits processors, so
    an EOS that is the argmax is emitted and decoding continues), using the
    model's KV cache. Returns only the new token ids.
    """
    return greedy_from_model(load_hf_model(gguf_path), ids, n)


def greedy_from_model(model, ids: list[int], n: int) -> list[int]:
    """``hf_greedy`` on an already built transformers model (e.g. one whose
    weights were placed by hand, see scripts/make_moe_reference.py)."""
    import torch

    # transformers >= 5.2x renamed past_key_values -> cache (input and output)
    ckey = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    new: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=True)
        for _ in range(n):
            tok = int(torch.argmax(out.logits[0, -1]))
            new.append(tok)
            if len(new) == n:
                break
            out = model(torch.tensor([[tok]], dtype=torch.long),
                        use_cache=True, **{ckey: getattr(out, ckey)})
    return new


def hf_greedy_manual(gguf_path, ids: list[int], n: int) -> list[int]:
    """Greedy decode by repeated full forward passes (slow; cross-checks
    ``hf_greedy`` without the KV cache)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(hf_logits(gguf_path, seq)[-1])))
    return seq[len(ids):]


if __name__ == "__main__":  # pragma: no cover - manual smoke test
    import sys

    path = sys.argv[1]
    toks = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 3]
    print("overrides:", hf_config_overrides(path))
    lg = hf_logits(path, toks)
    print("logits", lg.shape, "argmax last:", int(lg[-1].argmax()))
    print("greedy:", hf_greedy(path, toks, 8))
