"""The CUDA stage step: launched from the event loop, its completion an event the loop awaits.

    loop thread:  [settle: await an event if the stream may still be busy]
                  launch(): begin_step + kernels (or a decode graph replay); the last stage's logits DtoH into
                  pinned buffers, a middle stage's (x, h) stay on the device (DeviceHandoff)
                  record event on the stage's stream --await EventWaiter--> (the loop serves HTTP meanwhile)
    worker:       finish(copies of the pinned outputs): hand-off arrays or sampling

Nothing on the loop thread waits for a stream: while the backend is in deferred-host mode, `to_host` only
enqueues its copy (into pinned memory, which is also what makes it asynchronous), a graph replay returns
without synchronising, and `begin_step` reuses its staging buffer without a stream sync because the runner
marked the stream idle when the previous step's event completed. The pinned outputs are reused by the
stage's next step, so finish gets copies.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, Callable

import numpy as np


class StreamStepRunner:
    """StepRunner (engine/backends/step_runner.py) of one CudaBackend stage."""

    def __init__(self, backend, worker: Executor):
        self.backend = backend
        self.worker = worker

    async def run(self, launch: Callable[[], Any], finish: Callable[[Any], Any]) -> Any:
        b = self.backend
        if not b.is_idle:
            await self._await_stream()  # e.g. the weights' uploads before the first step
        with b.deferred_host():
            pending = launch()
        await self._await_stream()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, finish, _detach(pending))

    async def _await_stream(self) -> None:
        b = self.backend
        event = b.record_event()
        try:
            await b.wait(event)
        finally:
            b.release_event(event)
        b.mark_idle()


class PinnedOutputs:
    """The pinned host buffers a deferred step copies its outputs into, reused step after step (grown when an
    output outgrows its buffer): output i of a step goes to buffer i."""

    def __init__(self, device):
        self.device = device
        self._buffers: list = []
        self._used = 0

    def reset(self) -> None:
        self._used = 0

    def copy(self, x, stream) -> np.ndarray:
        """Enqueue x's DtoH copy; the returned view is valid once the stream's work so far has completed."""
        from engine.backends.cuda.device import PinnedBuffer

        i, self._used = self._used, self._used + 1
        if i == len(self._buffers):
            self._buffers.append(None)
        if self._buffers[i] is None or self._buffers[i].nbytes < x.nbytes:
            if self._buffers[i] is not None:
                self._buffers[i].close()
            self._buffers[i] = PinnedBuffer(max(x.nbytes, 1 << 16))
        self.device.dtoh(self._buffers[i].ptr, x.ptr, x.nbytes, stream)
        return self._buffers[i].view(x.dtype, x.shape)

    def close(self) -> None:
        for buffer in self._buffers:
            if buffer is not None:
                buffer.close()
        self._buffers = []


class DeviceHandoff:
    """A non-last stage's (x, h) left on the device for the next stage, with the event that marks them written.

    receive() runs on the next stage: its stream waits on that event, copies the arrays into its own
    workspace (DtoD), and the producing stage's stream then waits on the copies before the producer may reuse
    the source memory (its handles are dropped only after that wait is queued). Ordered by cuStreamWaitEvent
    on both sides; nothing waits on the host."""

    def __init__(self, arrays: tuple, event, owner):
        self.arrays, self.event, self.owner = arrays, event, owner

    def receive(self, backend) -> tuple:
        backend.wait_for(self.event, self.owner)
        copies = tuple(None if a is None else backend.copy_device(a) for a in self.arrays)
        self.owner.wait_for(backend.record_event(), backend)
        self.arrays = ()
        return copies


def _detach(value):
    """Copies of the host arrays in a pending output (tuples walked), so the pinned buffers can be reused."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value
