"""lfm2's short-conv states on the device, and the op that reads and rolls them (short_conv.cu).

`CudaConvStatePool` is engine/short_conv.ConvStatePool's interface (layers, rows, capture / captured, read,
write, take_captured, ensure_slot) with the states on the GPU: conv[layer] a DeviceArray [slots, L-1, d],
the kernel's `states`, updated in place by each step. Host transfers (a checkpoint read or written by the
conversation cache, scheduler/cache/hybrid_steps.py) run on the pool's own stream and wait for it: they happen on
the event loop between a sequence's steps, after the step that wrote the state has completed.

A checkpoint inside a chunk (the state after p tokens, p inside this step) is a window of the step's rows:

    window = [ state (L-1 rows; zeros at position 0) | u rows of the sequence ]      row j of the window
    state after p tokens = window[p - start_pos : p - start_pos + L-1]

so before the kernel rolls the state, `short_conv` copies that window out on the compute stream (DtoD, into
an arena buffer), and take_captured downloads it after the step.
"""
from __future__ import annotations

import threading

import numpy as np

from engine.backends.cuda.array import DeviceArray
from engine.batch import BatchMeta

_F32 = np.float32


class CudaConvStatePool:
    """Rolling conv states of a stage's short-conv layers on the device (see the module docstring)."""

    def __init__(self, backend, layers: tuple[int, ...], kernel: int, d_model: int, num_slots: int = 4):
        self.backend, self.device = backend, backend.device
        self.layers, self.rows, self.d_model = tuple(layers), kernel - 1, d_model
        self._lock = threading.Lock()  # the loop (read, write, new slots) and a stage's worker may both call
        self._stream = self.device.create_stream()
        self.num_slots = num_slots
        self.conv = {i: self._zeros((num_slots, self.rows, d_model), f"conv state of layer {i}") for i in self.layers}
        self.capture: dict[int, tuple[int, ...]] = {}
        self.captured: dict[tuple[int, int], dict[int, DeviceArray]] = {}

    @property
    def bytes_per_slot(self) -> int:
        return len(self.layers) * self.rows * self.d_model * 4

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv.values())

    def _alloc(self, shape, what: str) -> DeviceArray:
        nbytes = int(np.prod(shape)) * 4
        ptr = self.device.alloc(max(nbytes, 4), what)
        return DeviceArray(ptr, tuple(shape), _F32, self.backend, release=self.device.unreserve)

    def _zeros(self, shape, what: str) -> DeviceArray:
        array = self._alloc(shape, what)
        self.device.fill_u32(array.ptr, 0, array.size, self._stream)
        self.device.synchronize(self._stream)
        return array

    def _slot_bytes(self) -> int:
        return self.rows * self.d_model * 4

    def ensure_slot(self, slot: int) -> None:
        """Room for state row `slot` (doubling): a new buffer per layer with the old rows copied over, after
        every queued step (which may use the old buffers) has finished."""
        with self._lock:
            if slot < self.num_slots:
                return
            grown = max(slot + 1, 2 * self.num_slots)
            self.device.synchronize_context()
            for i, old in self.conv.items():
                new = self._zeros((grown, self.rows, self.d_model), f"conv state of layer {i}")
                self.device.dtod(new.ptr, old.ptr, old.nbytes, self._stream)
                self.conv[i] = new
            self.device.synchronize(self._stream)
            self.num_slots = grown

    def _download(self, ptr: int) -> np.ndarray:
        out = np.empty((self.rows, self.d_model), _F32)
        self.device.dtoh(out.ctypes.data, ptr, out.nbytes, self._stream)
        return out

    def read(self, slot: int) -> np.ndarray:
        """Copy of one slot's state, every layer of the pool: [layers, L-1, d]."""
        with self._lock:
            rows = [self._download(self.conv[i].ptr + slot * self._slot_bytes()) for i in self.layers]
            self.device.synchronize(self._stream)
        return self._stack(rows)

    def write(self, slot: int, state: np.ndarray) -> None:
        """Load [layers, L-1, d] into one slot (a checkpoint); returns once it is on the device."""
        self.ensure_slot(slot)
        state = np.ascontiguousarray(state, dtype=_F32)
        with self._lock:
            for j, i in enumerate(self.layers):
                self.device.htod(self.conv[i].ptr + slot * self._slot_bytes(), state[j].ctypes.data,
                                 self._slot_bytes(), self._stream)
            self.device.synchronize(self._stream)

    def take_captured(self, slot: int, position: int) -> np.ndarray:
        """The captured state after `position` tokens, every layer of the pool: [layers, L-1, d] (removed)."""
        found = self.captured.pop((slot, position), {})
        assert set(found) == set(self.layers), f"state after {position} tokens was not captured"
        with self._lock:
            rows = [self._download(found[i].ptr) for i in self.layers]
            self.device.synchronize(self._stream)
        return self._stack(rows)

    def _stack(self, rows: list[np.ndarray]) -> np.ndarray:
        return np.stack(rows) if rows else np.zeros((0, self.rows, self.d_model), _F32)

    def capture_window(self, b, u, layer: int, seq, position: int) -> None:
        """Copy the state after `position` tokens of seq (inside this step) out before the kernel rolls it."""
        R, row_bytes = self.rows, self.d_model * 4
        offset = position - seq.start_pos  # 1 .. query_len: window rows offset .. offset + R - 1
        dst = self._alloc((R, self.d_model), "conv state checkpoint")
        from_state = max(0, R - offset)  # rows of the previous state (its rows offset .. R - 1)
        if from_state and seq.start_pos > 0:
            src = self.conv[layer].ptr + (seq.state_slot * R + offset) * row_bytes
            b.device.dtod(dst.ptr, src, from_state * row_bytes, b.current_stream)
        elif from_state:  # at position 0 the state is zeros, whatever the slot holds
            b.device.fill_u32(dst.ptr, 0, from_state * self.d_model, b.current_stream)
        first_u = seq.query_start + max(offset - R, 0)
        b.device.dtod(dst.ptr + from_state * row_bytes, u.ptr + first_u * row_bytes, (R - from_state) * row_bytes,
                      b.current_stream)
        self.captured.setdefault((seq.state_slot, position), {})[layer] = dst


def short_conv(b, u, kernel, pool: CudaConvStatePool, layer: int, batch: BatchMeta):
    """u [T, d] -> [T, d] through short_conv_f32, each sequence's state row read and rolled in place."""
    T, d = u.shape
    for seq in batch.seqs:
        assert seq.state_slot >= 0, "a sequence of a hybrid model has no state slot"
        for p in pool.capture.get(seq.state_slot, ()):
            if seq.start_pos < p <= seq.context_len:
                pool.capture_window(b, u, layer, seq, p)
    seq_start, seq_len, start_pos, state_slot = _conv_index(b, batch)
    out = b.empty((T, d))
    b.launch("short_conv_f32", out=out, states=pool.conv[layer], u=u, w=kernel, seq_start=seq_start,
             seq_len=seq_len, start_pos=start_pos, state_slot=state_slot, n_seqs=len(batch.seqs), d=d,
             L=pool.rows + 1)
    return out


def _conv_index(b, batch: BatchMeta) -> tuple[int, int, int, int]:
    """Device addresses of the batch's per-sequence (query_start, query_len, start_pos, state_slot), uploaded
    once a step (every short-conv layer of the step reads the same)."""
    def table() -> np.ndarray:  # [4, n_seqs]
        return np.array([[s.query_start, s.query_len, s.start_pos, s.state_slot] for s in batch.seqs],
                        dtype=np.int32).T.copy()

    base, n = b.step_table(batch, "conv_index", table), len(batch.seqs)
    return tuple(base + i * n * 4 for i in range(4))
