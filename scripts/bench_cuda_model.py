"""A 1B-class llama-shaped GGUF with random weights, for benchmarking the CUDA backend where no model can be
downloaded (the GPU machine has no network). Written with the `gguf` writer and cached in /tmp.

Shape: d 2048, 16 layers, 32 query / 8 KV heads of 64, FFN 8192, vocab 32000 (about 1.1 B parameters),
matrices Q8_0 (or Q4_0). Every layer holds the same quantised bytes: the figures measure bandwidth and
launch overhead, for which the values do not matter, and quantising one layer instead of 16 saves a minute.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

SHAPE = dict(d=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=32000, context=4096)


def write_bench_model(path: Path, quant: str = "Q8_0", seed: int = 0) -> Path:
    """Write the model to path unless a file of that name exists already; returns path."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    path = Path(path)
    if path.exists():
        return path
    s, qt = SHAPE, GGMLQuantizationType[quant]
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols ** -0.5)
        return quantize(values, qt)

    started = time.perf_counter()
    q_dim, kv_dim = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layer = {"attn_q.weight": matrix(q_dim, s["d"]), "attn_k.weight": matrix(kv_dim, s["d"]),
             "attn_v.weight": matrix(kv_dim, s["d"]), "attn_output.weight": matrix(s["d"], q_dim),
             "ffn_gate.weight": matrix(s["ffn"], s["d"]), "ffn_up.weight": matrix(s["ffn"], s["d"]),
             "ffn_down.weight": matrix(s["d"], s["ffn"])}
    norm = np.ones(s["d"], dtype=np.float32)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("bench-1b-random")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["d"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["head_dim"])
    w.add_vocab_size(s["vocab"])
    w.add_tensor("token_embd.weight", matrix(s["vocab"], s["d"]), raw_dtype=qt)
    for i in range(s["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
        for name, data in layer.items():
            w.add_tensor(f"blk.{i}.{name}", data, raw_dtype=qt)
    w.add_tensor("output_norm.weight", norm)
    w.add_tensor("output.weight", matrix(s["vocab"], s["d"]), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="Q8_0", choices=("Q8_0", "Q4_0"))
    parser.add_argument("--out", default="/tmp/strata-bench-1b-{quant}.gguf")
    args = parser.parse_args()
    write_bench_model(Path(args.out.format(quant=args.quant)), args.quant)
