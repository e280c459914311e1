"""The Backend protocol: the few operations the model code is written against.

The model file (engine/model.py) calls only these, so the same code runs on numpy (the reference and CPU
default) and, later, on CUDA. Arrays are backend-owned handles; `to_host` brings one back as numpy.
Weights are uploaded once in the backend's preferred form (`upload_linear` takes the [out, in] float32
matrix as stored in GGUF; a backend may keep it transposed, quantised or on a device).

What a backend can do beyond the required ops it declares in `capabilities` (engine/backends/capabilities.py),
read by the model code instead of probing for methods; the ops a capability names exist when it is set:
- `quantized_linears`: `upload_linear_quantized(parts)` and `supports_quant_type(tensor_type)`: linears arrive
  as raw GGUF rows (engine/quant_weights.LinearPart), never dequantised (engine/weights.py); a type without a
  kernel is converted to `fallback_quant_type` (cuda, and numpy with --cpu-weights quantized);
- `quantized_embedding`: `upload_embedding_quantized(part)`: the token table arrives as raw rows too;
- not `on_host`: `device_free_bytes()`: the largest free piece of the device's memory after the weights, or
  None where it cannot be read (--kv-cache-mib auto sizes the K/V pool from it; cuda);
- `moe`: `route_experts` / `expert_ffn`; `stacked_experts`: `upload_experts` (cuda);
- `queued_moves`: `move_fence()` on a mover handle and `wait_for(event, mover)` on a stage backend: block
  moves are queued, not waited for, and the stage's next step is ordered after them on the device (cuda);
  ModelRunner calls them after every batch of moves.
Which architecture runs on which backend follows from `capabilities.layer_kinds` (engine/backends/placement.py).
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from engine.backends.capabilities import Capabilities
from engine.batch import BatchMeta
from engine.kv import KVLayout

Array = Any  # a backend's activation handle (numpy: np.ndarray)


class Backend(Protocol):
    name: str
    capabilities: Capabilities  # declared per class; see the module docstring

    # -- weights and memory ------------------------------------------------------------------------
    def upload(self, array: np.ndarray) -> Array:
        """A small float32 tensor (norm weights, biases, embedding table)."""

    def upload_linear(self, weight: np.ndarray) -> Array:
        """A matrix [out, in] used as y = x @ weight.T."""

    def create_kv_pool(self, layout: KVLayout, mapped_blocks: int | None = None) -> Any:
        """Allocate the paged K/V pool for every layer, rows of layout.kv_type (one of the backend's
        `kv_types`, a tuple whose first entry is its default for --kv-type auto). With mapped_blocks, an
        elastic pool: every id addressable, memory for the first mapped_blocks (`release_kv_blocks` resizes)."""

    def to_host(self, x: Array) -> np.ndarray: ...

    def copy_blocks(self, pool: Any, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer) from source to destination block ids (copy-on-write)."""

    def create_host_pool(self, layout: KVLayout) -> Any:
        """Host-RAM blocks for the conversation cache's host tier (pinned memory on CUDA): layout.num_blocks
        slots, committed now (0 is allowed: the tier then grows on demand)."""

    def grow_host_pool(self, host_pool: Any, num_blocks: int) -> None:
        """Commit host slots up to num_blocks in total; slots already there keep their ids and bytes."""

    def release_kv_blocks(self, pool: Any, num_blocks: int) -> None:
        """The elastic pool is num_blocks now: grown, ids up to it must be backed; shrunk, the memory of the ids
        above may go back (their bytes with it)."""

    def park_blocks(self, pool: Any, host_pool: Any, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host slot) pairs from the device pool to the host pool."""

    def restore_blocks(self, host_pool: Any, pool: Any, pairs: list[tuple[int, int]]) -> None:
        """Copy (host slot, device block) pairs from the host pool back to the device pool."""

    def read_block(self, pool: Any, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) of one block, every layer, as host numpy arrays [layers, KVH, block_size, row]: the stored
        rows of the pool's --kv-type (engine/kv_quant.py; int8 rows end in their scales)."""

    def write_block(self, pool: Any, block: int, k: np.ndarray, v: np.ndarray) -> None:
        """Inverse of read_block."""

    # -- ops (x rows are the flat batch rows of BatchMeta) -----------------------------------------
    def embedding(self, table: Array, token_ids: np.ndarray, scale: float) -> Array:
        """[T] ids -> [T, d] rows of table, times scale."""

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """RMS-normalise the last axis of x ([..., n]) and multiply by weight [n]."""

    def add_rms_norm(self, x: Array, delta: Array, weight: Array, eps: float) -> tuple[Array, Array]:
        """Residual add fused with the next norm: returns (x + delta, rms_norm(x + delta))."""

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """[T, in] -> [T, out]."""

    def split_heads(self, x: Array, sizes: tuple[int, ...], head_dim: int) -> tuple[Array, ...]:
        """Split [T, sum(sizes)] along columns and view each part as [T, size // head_dim, head_dim]."""

    def rope(self, x: Array, positions: np.ndarray, cos_sin: tuple[Array, Array], rope_dims: int) -> Array:
        """Rotate the first rope_dims of each head ([T, H, hd]) by position, half-split (NeoX) layout."""

    def store_kv(self, pool: Any, layer: int, k: Array, v: Array, batch: BatchMeta) -> None:
        """Write the new tokens' K/V ([T, KVH, hd]) to their slots; only rows batch.kv_write_rows where a
        backend sets `writes_kv_rows` (state windows, engine/state_window.py), else that is None."""

    def attention(self, q: Array, pool: Any, layer: int, batch: BatchMeta, scale: float, window: int) -> Array:
        """Causal paged attention of q [T, H, hd] over each sequence's context -> [T, H * hd].

        window > 0 limits each query to the last `window` positions (its own included).
        """

    def gated_activation(self, gate_up: Array, kind: str) -> Array:
        """[T, 2F] (gate | up) -> act(gate) * up, [T, F]."""

    def gather_rows(self, x: Array, rows: np.ndarray) -> Array: ...

    # -- pipeline stages (engine/stages.py, engine/sequence.py ModelRunner.run_stage) ------------------
    def for_stage(self, stage: int) -> "Backend":
        """The handle pipeline stage `stage` computes on: the same weights, its own stream and workspace
        where the backend has such (numpy: itself)."""

    def sibling(self) -> "Backend":
        """A handle for another thread (the event loop's block moves while a stage computes)."""

    def send_hidden(self, hidden: tuple) -> tuple:
        """A non-last stage's output (x, h) as the next stage may read it after this stage goes on."""

    def receive_hidden(self, hidden: tuple, batch: BatchMeta) -> tuple:
        """Start a step that enters at a later layer with the handed-off (x, h)."""

    def run_forward(self, model, batch: BatchMeta, pool: Any) -> np.ndarray:
        """model.forward(batch, pool) for a one-stage model (cuda: replayed from a graph when it can);
        engine/sequence.ModelRunner calls it."""

    def prepare_decode(self, model) -> None:
        """Build what decode steps of `model` need before serving (numpy quantized: the fused decoder and its
        repacked weights), so the first request does not pay for it."""

    def create_step_runner(self, worker) -> Any:
        """How a pipeline stage's step runs without blocking the event loop (engine/backends/step_runner.py:
        numpy on the stage's worker thread; cuda launched from the loop, its completion event awaited)."""

    # -- lfm2's short convolutions (engine/short_conv.py), where layer_kinds has short_conv -----------------
    def create_state_pool(self, layers: tuple[int, ...], kernel: int, d_model: int) -> Any:
        """The conv states of `layers` (ConvStatePool's interface; cuda keeps them on the device)."""

    def short_conv(self, u: Array, kernel: Array, pool: Any, layer: int, batch: BatchMeta) -> Array:
        """The depthwise causal convolution of u [T, d] with each sequence's state rows, rolling the states."""
