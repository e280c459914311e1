"""The forward-pass ops of the CUDA backend, one or two kernel launches each (docs/CUDA_KERNELS.md).

A mixin of CudaBackend (cuda/backend.py), which provides `empty`, `launch`, `_index` and `_seq_info`.
Every output is a fresh workspace array except `rope`, which rotates its input in place (the kernel's
contract) and returns it: the model never reads q or k again before the rotation.
Shapes: T = rows of the step, d = model width, H / KVH = query / KV heads, hd = head dim.
"""
from __future__ import annotations

import numpy as np

from cuda_kernels import attention as attention_geometry
from engine.backends.cuda import conv_state as cuda_conv_state
from engine.backends.cuda import linear as cuda_linear
from engine.backends.cuda import moe as cuda_moe
from engine.batch import BatchMeta, store_slots

CHUNK_KEYS = 512  # keys per flash-decoding chunk of paged_attention_split_f32
SPLIT_MAX_T = 64  # more query rows than this fill the GPU without splitting the keys
_ACTIVATIONS = {"silu": "gated_silu_f32", "gelu_tanh": "gated_gelu_tanh_f32"}  # swiglu_oai: cuda/moe.py


class CudaOps:
    """Backend ops as kernel launches on the backend's current stream."""

    def embedding(self, table, token_ids: np.ndarray, scale: float):
        # The first op of Model.forward: a step whose index arrays were not registered starts here.
        if (id(token_ids), "int32") not in self._step:
            self.begin_step()
        T, d = len(token_ids), table.shape[1]
        out = self.empty((T, d))  # [T, d]
        self.launch("embedding_f32", out=out, table=table, ids=self._index(token_ids, np.int32), T=T, d=d,
                    scale=scale)
        return out

    def rms_norm(self, x, weight, eps: float):
        n = x.shape[-1]
        out = self.empty(x.shape)  # [..., n]: rows = T, or T * H for QK-norm
        self.launch("rms_norm_f32", out=out, x=x, w=weight, rows=x.size // n, n=n, eps=eps)
        return out

    def add_rms_norm(self, x, delta, weight, eps: float):
        assert x.shape == delta.shape, f"add_rms_norm: {x.shape} + {delta.shape}"
        n = x.shape[-1]
        total, normed = self.empty(x.shape), self.empty(x.shape)
        self.launch("add_rms_norm_f32", sum_out=total, norm_out=normed, x=x, delta=delta, w=weight,
                    rows=x.size // n, n=n, eps=eps)
        return total, normed

    def add(self, a, b):
        assert a.shape == b.shape, f"add: {a.shape} + {b.shape}"
        out = self.empty(a.shape)
        self.launch("add_f32", out=out, a=a, b=b, n=a.size)
        return out

    def mul(self, a, b):
        assert a.shape == b.shape, f"mul: {a.shape} * {b.shape}"
        out = self.empty(a.shape)
        self.launch("mul_f32", out=out, a=a, b=b, n=a.size)
        return out

    def columns(self, x, start: int, count: int):
        T, in_cols = x.shape
        out = self.empty((T, count))  # [T, count]: columns start .. start + count of x
        self.launch("split_columns_f32", out=out, x=x, T=T, in_cols=in_cols, col_start=start, out_cols=count)
        return out

    def short_conv(self, u, kernel, pool, layer: int, batch: BatchMeta):
        """lfm2's causal conv (engine/short_conv.numpy_short_conv): u [T, d] -> [T, d], each sequence's state
        row read and rolled on the device (cuda_conv_state.CudaConvStatePool); captures first."""
        return cuda_conv_state.short_conv(self, u, kernel, pool, layer, batch)

    def linear(self, x, weight, bias=None):
        return cuda_linear.launch_linear(self, x, weight, bias)  # [T, in] -> [T, out]

    def split_heads(self, x, sizes: tuple[int, ...], head_dim: int):
        T, in_cols = x.shape
        parts, col = [], 0
        for size in sizes:
            out = self.empty((T, size))  # contiguous copy of columns col .. col + size
            self.launch("split_columns_f32", out=out, x=x, T=T, in_cols=in_cols, col_start=col, out_cols=size)
            parts.append(out.reshape(T, size // head_dim, head_dim))
            col += size
        return tuple(parts)

    def rope(self, x, positions: np.ndarray, cos_sin, rope_dims: int):
        T, H, hd = x.shape
        cos, sin = cos_sin  # [max_positions, rope_dims / 2]
        self.launch("rope_neox_f32", x=x, positions=self._index(positions, np.int32), cos=cos, sin=sin, T=T, H=H,
                    hd=hd, rope_dims=rope_dims)
        return x

    def store_kv(self, pool, layer: int, k, v, batch: BatchMeta) -> None:
        T, KVH, hd = k.shape
        self.launch(f"store_kv_{pool.layout.kv_type}", pool_layer_k=pool.layer_k(layer), pool_layer_v=pool.layer_v(layer), k=k, v=v,
                    slots=self._index(store_slots(batch), np.int64), T=T, KVH=KVH, hd=hd,
                    num_slots=pool.seg_slots, seg_rows=pool.seg_rows)

    def attention(self, q, pool, layer: int, batch: BatchMeta, scale: float, window: int, sinks=None):
        T, H, hd = q.shape
        lay = pool.layout
        token_seq, block_tables, max_blocks = self._seq_info(batch)
        out = self.empty((T, H * hd))
        args = dict(out=out, q=q, pool_k=pool.layer_k(layer), pool_v=pool.layer_v(layer), token_seq=token_seq,
                    token_pos=self._index(batch.positions, np.int32), block_tables=block_tables,
                    max_blocks=max_blocks, T=T, H=H, KVH=lay.n_kv_heads, hd=hd, block_size=lay.block_size,
                    num_slots=pool.seg_slots, seg_rows=pool.seg_rows, scale=scale, window=window)
        # Chunks over the widest key range the step can read (the table, or the window): the kernel's own
        # rule, since its grid has that many; a chunk past a query's own position is empty.
        n_chunks = attention_geometry.num_chunks(max_blocks, lay.block_size, CHUNK_KEYS, window)
        kv_type = lay.kv_type  # the kernel pair that reads this pool's rows (f32, f16, int8 + scales)
        # Sinks (gpt-oss) join the denominator in the combine, so such a layer always takes the split path.
        split = f"paged_attention_split_{kv_type}"
        if sinks is not None or (n_chunks > 1 and T <= SPLIT_MAX_T and self.kernels.has(split)):
            part_out = self.empty((T, H, n_chunks, hd))
            part_max, part_sum = self.empty((T, H, n_chunks)), self.empty((T, H, n_chunks))
            self.launch(f"paged_attention_split_{kv_type}", **args, part_out=part_out, part_max=part_max,
                        part_sum=part_sum, chunk_keys=CHUNK_KEYS)
            parts = dict(out=out, part_out=part_out, part_max=part_max, part_sum=part_sum, T=T, H=H, hd=hd,
                         n_chunks=n_chunks)
            if sinks is None:
                self.launch("attention_combine_f32", **parts)
            else:
                self.launch("attention_combine_sinks_f32", **parts, sinks=sinks)
        else:
            self.launch(f"paged_attention_{kv_type}", **args)
        return out  # [T, H * hd]

    def gated_activation(self, gate_up, kind: str):
        if kind not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {kind!r}")
        T, two_f = gate_up.shape
        out = self.empty((T, two_f // 2))
        self.launch(_ACTIVATIONS[kind], out=out, gate_up=gate_up, T=T, F=two_f // 2)
        return out

    # -- mixture of experts: engine/backends/cuda/moe.py --
    def route_experts(self, logits, k: int, gating: str, normalize: bool):
        return cuda_moe.route_experts(self, logits, k, gating, normalize)

    def expert_ffn(self, h, moe, ids, weights, activation: str):
        return cuda_moe.expert_ffn(self, h, moe.device, ids, weights, activation)

    def gather_rows(self, x, rows: np.ndarray):
        if len(rows) == x.shape[0]:
            return x  # every row wanted, in order (the numpy backend's shortcut too)
        n, d = len(rows), x.shape[1]
        out = self.empty((n, d))
        self.launch("gather_rows_f32", out=out, x=x, rows=self._index(rows, np.int64), n_rows=n, d=d)
        return out
