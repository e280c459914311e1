"""The CUDA backend: every Backend op (engine/backends/base.py) as launches of the kernels of docs/CUDA_KERNELS.md.

One CudaBackend per pipeline stage: several on one device share its context, arena and kernel modules
(cuda_device.get_device) but each has its own compute stream, copy stream and activation workspace, so
their work is ordered only where events say so. Activations are DeviceArrays from the workspace; weights
stay in their GGUF blocks (cuda_linear.py); the KV pool is one device allocation (cuda_kv.py).

A step's index arrays (token ids, positions, slots, block tables, logit rows) go to the device in one
copy through pinned memory when the step starts (`run_forward`, or the first op of `Model.forward`); the
ops find them by the identity of the batch's numpy arrays. Decode steps of common shapes replay a CUDA
graph (cuda_graphs.py). Ops are asynchronous; `to_host` synchronises, except in `deferred_host` mode, where
a pipeline stage's step is launched from the event loop (cuda_step.StreamStepRunner): then its copies go to
pinned buffers, a middle stage hands its (x, h) over on the device, and `record_event` + `await wait(event)`
let the loop learn of the step's end without blocking. Block moves are queued on the copy stream and fenced
by events (`move_fence` / `wait_for`), not waited for.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os

import numpy as np

from engine.backends import cuda_linear, cuda_moe
from engine.backends.cuda_arena import GrowingPool, round_up
from engine.backends.cuda_array import DeviceArray, blocks_needed_by, pack_layout, registry_keys, step_arrays
from engine.backends.cuda_device import PinnedBuffer, check, driver, get_device
from engine.backends.cuda_graphs import DecodeGraphs
from engine.backends.cuda_kv import CudaHostPool, CudaKVPool, KVTransfers
from engine.backends.cuda_step import DeviceHandoff, PinnedOutputs, StreamStepRunner
from engine.backends.cuda_ops import CudaOps
from engine.backends.cuda_wait import EventWaiter
from engine.backends.step_runner import ThreadStepRunner
from engine.batch import BatchMeta
from engine.kv import KVLayout

log = logging.getLogger("strata.cuda")
WORKSPACE_REGION_BYTES = 64 * 2**20  # activation memory is reserved from the arena in pieces of this size
STAGING_BYTES = 2**20  # pinned buffer for a step's index arrays (grows when a step needs more)
WAIT_ENV, GRAPHS_ENV = "STRATA_CUDA_WAIT", "STRATA_CUDA_GRAPHS"
NAN_BITS = 0x7FC00000


class CudaBackend(CudaOps):
    """Backend protocol on one GPU stream (see the module docstring); the ops are in cuda_ops.CudaOps.

    `stage` only names it in logs. Not thread-safe: one stage's ops come from one thread at a time.
    """

    name = "cuda"
    # --kv-type: f16 by default (half the bytes of f32, logits within docs/BENCHMARKS.md's bound), int8 with
    # per-token scales, f32 the reference; every type has its store and attention kernels (kv_blocks.cu, attention.cu).
    kv_types = ("f16", "int8", "f32")

    def __init__(self, device: int = 0, stream=None, stage: int = 0, wait_mode: str | None = None,
                 graphs: bool | None = None):
        self.device = get_device(device)
        self.kernels = self.device.kernel_set()
        self.stage = stage
        self.stream = stream if stream is not None else self.device.create_stream()
        self.copy_stream = self.device.create_stream()
        self.current_stream = self.stream  # the copy stream while a KV transfer runs (on_copy_stream)
        self._workspace = GrowingPool(self.device.reserve, WORKSPACE_REGION_BYTES, self.device.unreserve)
        self._pool = self._workspace  # a graph's private pool while it is captured
        self._capture = None  # the graph being captured (cuda_graphs._Graph), else None
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
        self.expert_cache = None  # cuda_expert_cache.ExpertCache, set before loading with --expert-cache-mib
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

    # -- memory ---------------------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32) -> DeviceArray:
        """Workspace memory for an activation (freed back to the workspace when the handle dies)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        pool = self._pool
        array = DeviceArray(pool.allocate(nbytes), shape, dtype, self, release=pool.free)
        if self.poison and self._capture is None:
            self.device.fill_u32(array.ptr, NAN_BITS, round_up(nbytes, 4) // 4, self.current_stream)
        return array

    def upload_bytes(self, data: np.ndarray, what: str, dtype=None) -> DeviceArray:
        """A persistent copy of a host array (weights): arena memory until the handle dies."""
        data = np.ascontiguousarray(data)
        ptr = self.device.alloc(data.nbytes, what)
        array = DeviceArray(ptr, data.shape, dtype or data.dtype, self, release=self.device.unreserve)
        self.device.htod(ptr, data.ctypes.data, data.nbytes, self.stream)
        self.synchronize_stream(self.stream)  # `data` may be a temporary: the copy must be done before it dies
        return array

    def upload_zeros(self, nbytes: int, what: str) -> DeviceArray:
        ptr = self.device.alloc(nbytes, what)
        array = DeviceArray(ptr, (nbytes // 4,), np.float32, self, release=self.device.unreserve)
        self.device.fill_u32(ptr, 0, nbytes // 4, self.stream)
        self.synchronize_stream(self.stream)
        return array

    def upload_activation(self, data: np.ndarray) -> DeviceArray:
        """A workspace copy of a host array, through the pinned staging buffer (no stream sync)."""
        assert self._capture is None, "host data reached an op during graph capture (not a registered index)"
        data = np.ascontiguousarray(data)
        if self._staging_used + data.nbytes > self._staging.nbytes:
            self._recycle_staging(data.nbytes)
        start = self._staging_used
        self._staging.array[start : start + data.nbytes] = data.reshape(-1).view(np.uint8)
        array = self.empty(data.shape, data.dtype)
        self.device.htod(array.ptr, self._staging.ptr + start, data.nbytes, self.current_stream)
        self._staging_used = start + round_up(max(data.nbytes, 1))
        return array

    def _recycle_staging(self, need: int) -> None:
        """Reuse the staging buffer from its start, once every copy queued from it has finished (known
        without a wait when the step runner saw the streams' last event complete)."""
        if not self._is_idle:
            self.synchronize_stream(self.stream)
            self.synchronize_stream(self.copy_stream)
        self._is_idle = False
        if need > self._staging.nbytes:
            self._staging.close()
            self._staging = PinnedBuffer(round_up(need, 2**20))
        self._staging_used = 0

    def index_array(self, values: np.ndarray) -> DeviceArray:
        return self.upload_activation(values)

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

    # -- mixture of experts (engine/backends/cuda_moe.py) --
    def upload_experts(self, gate, up, down, n_experts: int, biases=(None, None, None)) -> cuda_moe.CudaExperts:
        """Stacked expert tensors (LinearParts of E * rows) as one device buffer each, or into the expert cache
        (--expert-cache-mib); biases (gate [E, F], up [E, F], down [E, d] float32, or None) as given."""
        return cuda_moe.upload_experts(self, gate, up, down, n_experts, biases)

    def create_kv_pool(self, layout: KVLayout) -> CudaKVPool:
        return CudaKVPool(self, layout)

    def create_host_pool(self, layout: KVLayout) -> CudaHostPool:
        self.device.ensure_current()  # pinned memory belongs to the context current in this thread
        return CudaHostPool(layout)

    def release_kv_blocks(self, pool, num_blocks: int) -> None:
        raise NotImplementedError("an elastic KV pool on CUDA (cuMemAddressReserve / cuMemMap) is not built yet; "
                                  "leave --kv-cache-max-mib unset")

    def grow_host_pool(self, host_pool: CudaHostPool, num_blocks: int) -> None:
        self.device.ensure_current()
        host_pool.grow(num_blocks)

    def to_host(self, x: DeviceArray) -> np.ndarray:
        if self._capture is not None:  # the graph copies into its pinned output on every replay
            return self._capture.capture_output(x, self.current_stream)
        if self._defer_host:  # valid once the step's completion event has been observed
            return self._host_outputs.copy(x, self.current_stream)
        out = np.empty(x.shape, dtype=x.dtype)
        self.device.dtoh(out.ctypes.data, x.ptr, x.nbytes, self.current_stream)
        self.synchronize()
        return out

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

    # -- streams and events ---------------------------------------------------------------------------
    def create_step_runner(self, worker):
        """Pipeline stages launch this backend's steps from the event loop and await their events; with an
        expert cache, on the stage's worker thread (each MoE layer waits for its routing read-back)."""
        if self.expert_cache is not None:
            return ThreadStepRunner(worker)
        return StreamStepRunner(self, worker)

    @property
    def is_idle(self) -> bool:
        return self._is_idle

    def mark_idle(self) -> None:
        """The caller observed an event recorded after all of this backend's queued work complete."""
        self._is_idle = True

    @contextlib.contextmanager
    def deferred_host(self):
        """to_host and graph replays enqueue their copies into pinned buffers and return without waiting;
        the results are valid after an event recorded at the end has completed (cuda_step.StreamStepRunner)."""
        self._defer_host = True
        self._host_outputs.reset()
        try:
            yield
        finally:
            self._defer_host = False

    def launch(self, kernel: str, **args) -> None:
        self._is_idle = False
        self.device.ensure_current()
        self.kernels.launch(kernel, self.current_stream, **args)

    def synchronize(self) -> None:
        self.synchronize_stream(self.current_stream)

    def synchronize_stream(self, stream) -> None:
        self.device.synchronize(stream)

    @contextlib.contextmanager
    def on_copy_stream(self):
        """Run the enclosed launches and copies on the copy stream, after the compute stream's queued work
        (which may still read memory the transfer's staging reuses); returns once they are queued, with the
        compute stream made to wait for them (its later work, and a workspace block reused there, come after)."""
        event = self.record_event(self.stream)
        check(driver.cuStreamWaitEvent(self.copy_stream, event, 0), "cuStreamWaitEvent")
        self._events.append(event)  # reusable at once: a wait takes the event's state when it is queued
        self.current_stream = self.copy_stream
        try:
            yield
        finally:
            self.current_stream = self.stream
            done = self.record_event(self.copy_stream)
            check(driver.cuStreamWaitEvent(self.stream, done, 0), "cuStreamWaitEvent")
            self._events.append(done)
            self._is_idle = False

    def move_fence(self):
        """An event after every block move this (mover) backend queued; pass it to the stage's `wait_for`."""
        return self.record_event(self.stream)

    def wait_for(self, event, owner: "CudaBackend") -> None:
        """Order this backend's later work after `event` (cuStreamWaitEvent, no host wait); owner's pool gets
        the event back."""
        self.device.ensure_current()
        check(driver.cuStreamWaitEvent(self.stream, event, 0), "cuStreamWaitEvent")
        owner.release_event(event)
        self._is_idle = False

    def record_event(self, stream=None):
        """An event marking the work queued so far on stream (default: the compute stream)."""
        event = self._events.pop() if self._events else self.device.create_event()
        self.device.ensure_current()
        check(driver.cuEventRecord(event, stream if stream is not None else self.stream), "cuEventRecord")
        return event

    async def wait(self, event) -> None:
        """Await the event's completion without blocking the event loop (thread or polling, see cuda_wait)."""
        await self.waiter.wait(event)

    def release_event(self, event) -> None:
        self._events.append(event)

    @staticmethod
    def _event_done(event) -> bool:
        err, = driver.cuEventQuery(event)
        if int(err) == int(driver.CUresult.CUDA_ERROR_NOT_READY):
            return False
        check((err,), "cuEventQuery")
        return True

    @staticmethod
    def _event_sync(event) -> None:
        check(driver.cuEventSynchronize(event), "cuEventSynchronize")

    # -- one step ---------------------------------------------------------------------------------------
    def run_forward(self, model, batch: BatchMeta, pool: CudaKVPool) -> np.ndarray:
        """model.forward(batch, pool), replayed from a CUDA graph when the step's shape has one."""
        if self.graphs is not None and self.graphs.eligible(batch):
            return self.graphs.run(model, batch, pool)
        self.begin_step(batch)
        return model.forward(batch, pool)

    def begin_step(self, batch: BatchMeta | None = None) -> None:
        """Forget the previous step's index arrays; with a batch, upload all of this step's in one copy.

        Model.forward starts one implicitly (its embedding op); a pipeline stage that starts at a later layer
        calls this before its first op.
        """
        self._recycle_staging(0)
        self.forget_step()
        if self.expert_cache is not None:
            self.expert_cache.at_step_start()  # a resize the budget asked for happens between steps only
        if batch is not None:
            max_blocks = blocks_needed_by(batch)
            arrays = step_arrays(batch, max_blocks)
            offsets, total = pack_layout(arrays)
            packed = np.zeros(total, dtype=np.uint8)
            for name, array in arrays.items():
                packed[offsets[name] : offsets[name] + array.nbytes] = array.view(np.uint8)
            device_copy = self.upload_activation(packed)
            self.register_step(batch, {n: device_copy.ptr + offsets[n] for n in arrays}, max_blocks,
                               keep=[device_copy])

    def forget_step(self) -> None:
        """Drop the current step's registered index arrays (their device copies return to the workspace)."""
        self._step.clear()
        self._step_keep.clear()

    def register_step(self, batch: BatchMeta, addresses: dict[str, int], max_blocks: int, keep=()) -> None:
        """Make the ops of this step find the batch's index arrays at `addresses` (see cuda_array)."""
        for name, key in registry_keys(batch).items():
            self._step[key] = addresses[name]
        self._step[(id(batch), "max_blocks")] = max_blocks
        self._step_keep += [batch, *keep]

    def _index(self, values: np.ndarray, dtype) -> int:
        """Device address of a step's index array as dtype: the registered copy, else uploaded now."""
        key = (id(values), np.dtype(dtype).name)
        if key not in self._step:
            copy = self.upload_activation(np.asarray(values, dtype=dtype))
            self._step[key] = copy.ptr
            self._step_keep += [values, copy]
        return self._step[key]

    def _seq_info(self, batch: BatchMeta) -> tuple[int, int, int]:
        """(token_seq, block_tables, max_blocks) of the batch on the device."""
        if (id(batch), "max_blocks") not in self._step:
            max_blocks = blocks_needed_by(batch)
            arrays = step_arrays(batch, max_blocks)
            token_seq, tables = (self.upload_activation(arrays[n]) for n in ("token_seq", "block_tables"))
            self._step[(id(batch), "token_seq")] = token_seq.ptr
            self._step[(id(batch), "block_tables")] = tables.ptr
            self._step[(id(batch), "max_blocks")] = max_blocks
            self._step_keep += [batch, token_seq, tables]
        return (self._step[(id(batch), "token_seq")], self._step[(id(batch), "block_tables")],
                self._step[(id(batch), "max_blocks")])

    def close(self) -> None:
        """Stop the waiter thread and free graphs (the device and its arena stay for other stages)."""
        self.waiter.close()
        self._host_outputs.close()
        if self.graphs is not None:
            self.graphs.clear()
