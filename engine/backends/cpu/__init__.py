"""The CPU backend: the reference backend with its linears kept in their GGUF blocks, and the numba kernels that
compute on them (`--backend numpy`, `--cpu-weights quantized*`).

backend.py is the Backend; quant_linear.py a quantised linear; gguf_dequant.py / gguf_row_kernels.py the
kernels on raw GGUF rows; int8_* the integer-activation products; fused_* the one-call decode step;
prefill_attention.py the tiled prefill attention. cpu/numba_cache_deps.py keys each kernel module's disk cache on
the kernel files it inlines.
"""
