"""Activation and weight memory of the CUDA backend: workspace arrays, persistent uploads, the staging buffer.

A mixin of CudaBackend (cuda/backend.py). Its state is created by CudaBackend.__init__: `_pool` (the
workspace, or a graph's private pool while one is captured), `_capture`, `_staging` / `_staging_used` (the
pinned buffer host arrays go up through) and `_is_idle` (shared with streams: set by `mark_idle` only).

    staging (pinned): [ array 0 | array 1 | ... ]--HtoD each, on the current stream-->  workspace arrays
                      reused from its start once every copy queued from it has finished
"""
from __future__ import annotations

import math

import numpy as np

from engine.backends.cuda.arena import round_up
from engine.backends.cuda.array import DeviceArray
from engine.backends.cuda.device import PinnedBuffer
from engine.units import MIB

WORKSPACE_REGION_BYTES = 64 * MIB  # activation memory is reserved from the arena in pieces of this size
STAGING_BYTES = MIB  # pinned buffer for a step's index arrays (grows when a step needs more)
NAN_BITS = 0x7FC00000


class CudaMemory:
    """Device memory of one backend: `empty` (workspace), `upload_*` (arena or workspace), `to_host`."""

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
            self._staging = PinnedBuffer(round_up(need, MIB))
        self._staging_used = 0

    def device_free_bytes(self) -> int | None:
        """The device arena's largest free piece (after the weights): --kv-cache-mib auto sizes the pool from it."""
        return self.device.arena.largest_free

    def capture_into(self, graph) -> None:
        """While a graph (graphs._Graph) is captured: activations come from its private pool and to_host
        copies into its pinned output; until end_capture."""
        self._pool, self._capture = graph.pool, graph

    def end_capture(self) -> None:
        self._pool, self._capture = self._workspace, None

    def index_array(self, values: np.ndarray) -> DeviceArray:
        return self.upload_activation(values)

    def to_host(self, x: DeviceArray) -> np.ndarray:
        if self._capture is not None:  # the graph copies into its pinned output on every replay
            return self._capture.capture_output(x, self.current_stream)
        if self._defer_host:  # valid once the step's completion event has been observed
            return self._host_outputs.copy(x, self.current_stream)
        out = np.empty(x.shape, dtype=x.dtype)
        self.device.dtoh(out.ctypes.data, x.ptr, x.nbytes, self.current_stream)
        self.synchronize()
        return out
