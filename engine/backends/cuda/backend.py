"""The CUDA backend: every Backend op (engine/backends/base.py) as launches of the kernels of docs/CUDA_KERNELS.md.

One CudaBackend per pipeline stage: several on one device share its context, arena and kernel modules
(device.get_device) but each has its own compute stream, copy stream and activation workspace, so
their work is ordered only where events say so. Activations are DeviceArrays from the workspace; weights
stay in their GGUF blocks (cuda/linear.py); the KV pool is one device allocation (cuda/kv.py).

A step's index arrays (token ids, positions, slots, block tables, logit rows) go to the device in one
copy through pinned memory when the step starts (`run_forward`, or the first op of `Model.forward`); the
ops find them by the identity of the batch's numpy arrays. Decode steps of common shapes replay a CUDA
graph (cuda/graphs.py). Ops are asynchronous; `to_host` synchronises, except in `deferred_host` mode, where
a pipeline stage's step is launched from the event loop (step.StreamStepRunner): then its copies go to
pinned buffers, a middle stage hands its (x, h) over on the device, and `record_event` + `await wait(event)`
let the loop learn of the step's end without blocking. Block moves are queued on the copy stream and fenced
by events (`move_fence` / `wait_for`), not waited for.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from engine.backends.capabilities import ATTENTION, SHORT_CONV, Capabilities
from engine.backends.cuda import launch as cuda_launch
from engine.backends.cuda import linear as cuda_linear

from engine.backends.cuda import moe as cuda_moe
from engine.backends.cuda.arena import GrowingPool
from engine.backends.cuda.array import DeviceArray
from engine.backends.cuda.conv_state import CudaConvStatePool
from engine.backends.cuda.device import PinnedBuffer, get_device
from engine.backends.cuda.graphs import DecodeGraphs
from engine.backends.cuda.kv import CudaHostPool, CudaKVPool, KVTransfers
from engine.backends.cuda.kv_elastic import SEGMENT_BLOCKS, ElasticKVPool
from engine.backends.cuda.memory import STAGING_BYTES, WORKSPACE_REGION_BYTES, CudaMemory
from engine.backends.cuda.ops import CudaOps
from engine.backends.cuda.step import DeviceHandoff, PinnedOutputs
from engine.backends.cuda.step_index import CudaStepIndex
from engine.backends.cuda.streams import CudaStreams
from engine.backends.cuda.wait import EventWaiter
from engine.batch import BatchMeta
from engine.kv import KVLayout

log = logging.getLogger("strata.cuda")
WAIT_ENV, GRAPHS_ENV = "STRATA_CUDA_WAIT", "STRATA_CUDA_GRAPHS"


class CudaBackend(CudaMemory, CudaStreams, CudaStepIndex, CudaOps):
    """Backend protocol on one GPU stream (see the module docstring). Its parts: memory (memory), streams
    and events (streams), a step's index arrays (step_index), the forward ops (ops); this class
    creates their state and holds the stage, weight-upload and KV-pool parts of the protocol.

    `stage` only names it in logs. Not thread-safe: one stage's ops come from one thread at a time.
    """

    name = "cuda"
    capabilities = Capabilities(
        on_host=False,
        # --kv-type: f16 by default (half the bytes of f32, logits within docs/BENCHMARKS.md's bound), int8 with
        # per-token scales, f32 the reference; every type has its store and attention kernels (kv_blocks.cu,
        # attention.cu).
        kv_types=("f16", "int8", "f32"),
        writes_kv_rows=True,  # store_kv skips a state window's rows (slot -1, kv_blocks.cu): lfm2 windows run here
        quantized_linears=True, moe=True, stacked_experts=True, attention_sinks=True, expert_cache=True,
        queued_moves=True, layer_kinds=frozenset({ATTENTION, SHORT_CONV}))  # short_conv.cu; no DeltaNet kernels

    def __init__(self, device: int = 0, stream=None, stage: int = 0, wait_mode: str | None = None,
                 graphs: bool | None = None):
        self.device = get_device(device)
        self.kernels = cuda_launch.kernel_set(self.device)
        self.stage = stage
        self.stream = stream if stream is not None else self.device.create_stream()
        self.copy_stream = self.device.create_stream()
        self.current_stream = self.stream  # the copy stream while a KV transfer runs (on_copy_stream)
        self._workspace = GrowingPool(self.device.reserve, WORKSPACE_REGION_BYTES, self.device.unreserve)
        self._pool = self._workspace  # a graph's private pool while it is captured
        self._capture = None  # the graph being captured (graphs._Graph), else None
        self._step: dict[tuple[int, str], int] = {}  # registry_keys -> device address, for the current step
        self._step_keep: list = []  # what keeps the registered ids and device buffers alive for the step
        self._staging = PinnedBuffer(STAGING_BYTES)
        self._staging_used = 0
        self._events: list = []
        self._is_idle = False  # no work queued on the streams: set only by mark_idle (an observed event)
        self._defer_host = False  # inside a StreamStepRunner launch: to_host enqueues, never waits
        self._host_outputs = PinnedOutputs(self.device)
        self.poison = False  # tests: fill every new activation with NaN so an unwritten element shows
        self.waiter = EventWaiter(wait_mode or os.environ.get(WAIT_ENV, "thread"), self._event_done,
                                  self._event_sync, self.device.make_current)
        use_graphs = graphs if graphs is not None else os.environ.get(GRAPHS_ENV, "1") != "0"
        self.graphs = DecodeGraphs(self) if use_graphs else None
        self.kv = KVTransfers(self)
        self.expert_cache = None  # cuda.expert_cache.cache.ExpertCache, set before loading with --expert-cache-mib
        self.kv_segment_blocks = SEGMENT_BLOCKS  # an elastic pool's layout segment (tests make it small)
        log.info("backend cuda stage %d on device %d (%s), wait=%s, graphs=%s", stage, self.device.ordinal,
                 self.device.name, self.waiter.mode, "on" if self.graphs else "off")

    # -- pipeline stages ------------------------------------------------------------------------------
    def for_stage(self, stage: int) -> "CudaBackend":
        """The backend of pipeline stage `stage` on this device: the same context, arena, kernels and
        weights, its own streams and workspace (stage 0 is this backend itself)."""
        if stage == self.stage:
            return self
        backend = CudaBackend(self.device.ordinal, stage=stage, wait_mode=self.waiter.mode,
                              graphs=self.graphs is not None)
        backend.expert_cache = self.expert_cache  # the experts are shared, so is their cache
        return backend

    def sibling(self) -> "CudaBackend":
        """Another handle on this device for another thread: the event loop moves cache blocks (park,
        restore, copy) while the stage's worker computes, and a backend's streams, workspace and staging
        belong to one thread at a time."""
        return CudaBackend(self.device.ordinal, stage=self.stage, wait_mode=self.waiter.mode, graphs=False)

    def send_hidden(self, hidden: tuple):
        """A stage's output (x, h) for the next stage, which reads it while this stage's workspace goes on
        with its next job: launched from the loop (deferred mode), a DeviceHandoff ordered by events; else
        host arrays (synchronises this stage's stream)."""
        if self._defer_host:
            return DeviceHandoff(tuple(hidden), self.record_event(), self)
        return tuple(None if a is None else self.to_host(a) for a in hidden)

    def receive_hidden(self, hidden, batch: BatchMeta) -> tuple:
        """Start a step that enters at a later layer: its index arrays and the handed-off (x, h) go to this
        stage's workspace (DtoD after the producer's event, or uploaded from host arrays)."""
        self.begin_step(batch)
        if isinstance(hidden, DeviceHandoff):
            return hidden.receive(self)
        return tuple(None if a is None else self.upload_activation(np.asarray(a, dtype=np.float32)) for a in hidden)

    def copy_device(self, src: DeviceArray) -> DeviceArray:
        """A copy of a device array (another stage's, same device) in this backend's workspace, on its stream."""
        out = self.empty(src.shape, src.dtype)
        self.device.dtod(out.ptr, src.ptr, src.nbytes, self.stream)
        self._is_idle = False
        return out

    # -- Backend protocol: weights and memory ---------------------------------------------------------
    def upload(self, array: np.ndarray) -> DeviceArray:
        return self.upload_bytes(np.ascontiguousarray(array, dtype=np.float32), f"tensor {np.shape(array)}")

    def upload_linear(self, weight: np.ndarray) -> cuda_linear.QuantLinear:
        return cuda_linear.float_linear(self, weight)

    def upload_linear_quantized(self, parts) -> cuda_linear.QuantLinear:
        """Raw GGUF rows (engine/quant_weights.LinearPart), stacked along the output dimension."""
        return cuda_linear.upload_parts(self, list(parts))

    def supports_quant_type(self, tensor_type) -> bool:
        return cuda_linear.supports(tensor_type)

    # -- mixture of experts (engine/backends/cuda/moe.py) --
    def upload_experts(self, gate, up, down, n_experts: int, biases=(None, None, None)) -> cuda_moe.CudaExperts:
        """Stacked expert tensors (LinearParts of E * rows) as one device buffer each, or into the expert cache
        (--expert-cache-mib); biases (gate [E, F], up [E, F], down [E, d] float32, or None) as given."""
        return cuda_moe.upload_experts(self, gate, up, down, n_experts, biases)

    def create_kv_pool(self, layout: KVLayout, mapped_blocks: int | None = None):
        """A fixed pool of layout.num_blocks (arena memory), or with mapped_blocks an elastic one: every id
        reserved, the first mapped_blocks backed, `release_kv_blocks` resizing it (cuda/kv_elastic.py)."""
        if mapped_blocks is None:
            return CudaKVPool(self, layout)
        return ElasticKVPool(self, layout, mapped_blocks, self.kv_segment_blocks)

    def create_state_pool(self, layers: tuple[int, ...], kernel: int, d_model: int) -> CudaConvStatePool:
        """lfm2: the short-conv states of a stage's recurrent layers, on the device (cuda/conv_state.py)."""
        return CudaConvStatePool(self, layers, kernel, d_model)

    def create_host_pool(self, layout: KVLayout) -> CudaHostPool:
        self.device.ensure_current()  # pinned memory belongs to the context current in this thread
        return CudaHostPool(layout)

    def release_kv_blocks(self, pool, num_blocks: int) -> None:
        """The cache's pool is num_blocks now (grown or shrunk): an elastic pool maps or unmaps chunks to
        match (new memory zeroed on this backend's stream); a fixed one keeps its memory."""
        pool.resize(num_blocks, self)

    def grow_host_pool(self, host_pool: CudaHostPool, num_blocks: int) -> None:
        self.device.ensure_current()
        host_pool.grow(num_blocks)

    def copy_blocks(self, pool: CudaKVPool, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.kv.copy_blocks(pool, pairs)

    def park_blocks(self, pool: CudaKVPool, host_pool: CudaHostPool, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.kv.park(pool, host_pool, pairs)

    def restore_blocks(self, host_pool: CudaHostPool, pool: CudaKVPool, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.kv.restore(host_pool, pool, pairs)

    def read_block(self, pool, block: int):
        return self.kv.read_block(pool, block)

    def write_block(self, pool, block: int, k: np.ndarray, v: np.ndarray) -> None:
        self.kv.write_block(pool, block, k, v)

    def prepare_decode(self, model) -> None:
        pass  # decode graphs are captured per shape at their first step (graphs.py)

    def close(self) -> None:
        """Stop the waiter thread and free graphs (the device and its arena stay for other stages)."""
        self.waiter.close()
        self._host_outputs.close()
        if self.graphs is not None:
            self.graphs.clear()
