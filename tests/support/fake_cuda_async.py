"""The fake driver of tests/support/fake_cuda.py with streams that really run later: one worker thread per stream.

tests/support/fake_cuda.py runs all work at launch, so every event is complete the moment it is recorded and nothing
can show whether the event loop waits for a step without blocking. Here work queued on a stream (kernels,
async copies, graph launches, event records, waits on events) runs in order on that stream's thread, an
optional `kernel_delay_s` makes every kernel slow, and every call that blocks the caller until device work is
done (cuStreamSynchronize, cuEventSynchronize, a DtoH copy into pageable memory, which CUDA performs
synchronously) is logged with its thread in `blocking_calls`. HtoD copies read their source at the call, as
CUDA does for pageable memory, so a temporary host array may die after the call.
"""
from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
import traceback

from engine.backends.cuda import abi as cuda_abi
from tests.support import fake_cuda
from tests.support.fake_cuda import OK, CUresult, FakeDriver
from tests.support.fake_cuda_kernels import KERNELS


class _Stream:
    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()


class AsyncStreamsDriver(FakeDriver):
    """FakeDriver whose streams run their work on threads of their own (see the module docstring)."""

    def __init__(self, kernel_delay_s: float = 0.0):
        super().__init__()
        self.kernel_delay_s = kernel_delay_s
        self.kernel_delays: dict[str, float] = {}  # kernel name -> its own delay (overrides kernel_delay_s)
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, threading.Event] = {}  # event -> its latest record's completion
        self._pinned: set[int] = set()
        self.blocking_calls: list[tuple[str, str]] = []  # (call, thread name)
        self.launch_threads: set[str] = set()
        self.copy_log: list[str] = []  # "HtoD" / "DtoH" / "DtoD", in call order  # the threads kernels were launched from
        self.blocking_stacks: list[str] = []  # where each was called from (for a failing test's message)
        self._lock = threading.Lock()

    def _stream(self, stream) -> _Stream:
        with self._lock:
            if stream not in self._streams:
                self._streams[stream] = _Stream(f"fake-stream-{stream}")
            return self._streams[stream]

    def _block(self, call: str) -> None:
        self.blocking_calls.append((call, threading.current_thread().name))
        self.blocking_stacks.append("".join(traceback.format_stack(limit=12)))

    def run_on_stream(self, stream, work):
        if not self.has_context():
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if stream in self.capturing:
            self.capturing[stream].append(work)
        else:
            self._stream(stream).jobs.put(work)
        return (OK,)

    def kernel(self, name: str, work):
        """A launch's work, made slow by kernel_delays / kernel_delay_s (_SlowKernelSet routes launches here)."""
        delay = self.kernel_delays.get(name, self.kernel_delay_s)

        def slow():
            if delay:
                time.sleep(delay)
            work()
        return slow

    def cuMemHostAlloc(self, nbytes, flags):
        err, ptr = super().cuMemHostAlloc(nbytes, flags)
        self._pinned.add(int(ptr))
        return err, ptr

    def _is_pinned(self, address: int) -> bool:
        return any(p <= address < p + self._keep[p].nbytes for p in self._pinned if p in self._keep)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        self.copy_log.append("HtoD")
        if self.unmapped((dst, n), (src, n)):
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        if self._is_pinned(int(src)):  # read in stream order (a graph replays it with new inputs)
            return self.run_on_stream(stream, lambda: ctypes.memmove(int(dst), int(src), n))
        data = ctypes.string_at(int(src), n)  # pageable: read now, the source may be a temporary
        return self.run_on_stream(stream, lambda: ctypes.memmove(int(dst), data, n))

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        self.copy_log.append("DtoH")
        if self.unmapped((dst, n), (src, n)):
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        result = self.run_on_stream(stream, lambda: ctypes.memmove(int(dst), int(src), n))
        if not self._is_pinned(int(dst)) and stream not in self.capturing:
            self._block("cuMemcpyDtoHAsync(pageable)")
            self._drain(stream)
        return result

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        self.copy_log.append("DtoD")
        if self.unmapped((dst, n), (src, n)):
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        return self.run_on_stream(stream, lambda: ctypes.memmove(int(dst), int(src), n))

    def _drain(self, stream) -> None:
        done = threading.Event()
        self._stream(stream).jobs.put(done.set)
        done.wait()

    def cuEventRecord(self, event, stream):
        done = threading.Event()
        self._events[event] = done
        return self.run_on_stream(stream, done.set)

    def cuEventQuery(self, event):
        done = self._events.get(event)
        return (OK,) if done is None or done.is_set() else (CUresult.CUDA_ERROR_NOT_READY,)

    def cuEventSynchronize(self, event):
        self._block("cuEventSynchronize")
        done = self._events.get(event)
        if done is not None:
            done.wait()
        return (OK,)

    def cuStreamWaitEvent(self, stream, event, flags):
        done = self._events.get(event)
        return (OK,) if done is None else self.run_on_stream(stream, done.wait)

    def cuStreamSynchronize(self, stream):
        if stream in self.capturing:
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        self._block("cuStreamSynchronize")
        self._drain(stream)
        return (OK,)

    def cuGraphLaunch(self, graph_exec, stream):
        for work in graph_exec:
            self.run_on_stream(stream, work)
        return (OK,)

    def cuCtxSynchronize(self):
        self._block("cuCtxSynchronize")
        for stream in list(self._streams):
            self._drain(stream)
        return (OK,)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.jobs.put(None)


class _SlowKernelSet(fake_cuda.FakeKernelSet):
    """FakeKernelSet whose launches run kernel_delay_s late on the stream's thread."""

    def launch(self, kernel: str, stream, **args) -> None:
        values, _ = cuda_abi.pack(kernel, args)
        a = {cuda_abi.arg_name(p): (int(v.value or 0) if kind == "ptr" else v.value)
             for (p, kind), v in zip(cuda_abi.params(kernel), values)}
        self.driver.launches.append(kernel)
        self.driver.launch_threads.add(threading.current_thread().name)
        base = kernel.split("_")[0] if kernel.startswith(("matvec_", "gemm_")) else kernel
        err, = self.driver.run_on_stream(stream, self.driver.kernel(kernel, lambda: KERNELS[base](kernel, a)))
        assert err == OK, f"{kernel} launched from a thread without a current context"


def install(monkeypatch, kernel_delay_s: float = 0.0) -> AsyncStreamsDriver:
    """fake_cuda.install with an AsyncStreamsDriver (and kernels slowed by kernel_delay_s)."""
    from engine.backends.cuda import device as cuda_device
    from engine.backends.cuda import launch as cuda_launch

    fake = AsyncStreamsDriver(kernel_delay_s)
    fake_cuda.patch_driver(monkeypatch, fake)
    monkeypatch.setattr(cuda_device, "_devices", {})
    monkeypatch.setattr(cuda_launch, "kernel_set", lambda device: device.__dict__.setdefault(
        "_fake_kernels", _SlowKernelSet(fake)))
    monkeypatch.setitem(sys.modules, "cuda_kernels.quant_types", fake_cuda._fake_quant_types())
    monkeypatch.setenv("STRATA_CUDA_ARENA_MIB", str(fake_cuda.ARENA_BYTES // 2**20))
    return fake
