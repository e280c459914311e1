"""Streams and events of the CUDA backend: launches, synchronisation, the copy stream, fences and waits.

A mixin of CudaBackend (cuda/backend.py). Its state is created by CudaBackend.__init__: `stream` (compute),
`copy_stream` (KV transfers), `current_stream` (the one launches go to), `_events` (a free list of events),
`_is_idle`, `_defer_host`, `_host_outputs` and `waiter` (wait.EventWaiter).

    compute stream: ... work ... [record e1] ............ [wait e2] next step
    copy stream:                  [wait e1] park / restore [record e2]        (on_copy_stream)
"""
from __future__ import annotations

import contextlib

from engine.backends.cuda.device import check, driver
from engine.backends.cuda.step import StreamStepRunner
from engine.backends.step_runner import ThreadStepRunner


class CudaStreams:
    """Launch on the current stream; order streams by events, never by a host wait where avoidable."""

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

    @property
    def defers_host(self) -> bool:
        """Inside `deferred_host`: results are copied out once the step's event is observed, not waited for."""
        return self._defer_host

    @contextlib.contextmanager
    def deferred_host(self):
        """to_host and graph replays enqueue their copies into pinned buffers and return without waiting;
        the results are valid after an event recorded at the end has completed (step.StreamStepRunner)."""
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

    def launch_graph(self, graph_exec) -> None:
        """Replay an instantiated CUDA graph (cuda/graphs.py) on the compute stream."""
        self.device.ensure_current()
        check(driver.cuGraphLaunch(graph_exec, self.stream), "cuGraphLaunch")
        self._is_idle = False

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

    def wait_for(self, event, owner) -> None:
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
        """Await the event's completion without blocking the event loop (thread or polling, see wait)."""
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
