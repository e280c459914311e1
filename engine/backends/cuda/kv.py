"""The KV pool on the device, its pinned host tier, and the block copies between them.

Device pool: one allocation [layers, 2 (K, V), KVH, num_slots, row] (docs/CUDA_KERNELS.md; an elastic pool is
segments of that shape, cuda/kv_elastic.py), a row being one
token's K or V of one head in the --kv-type (f32, f16, or int8 + its float32 scale: engine/kv_quant.py). The
block moves see rows as 32-bit words (row_words = row bytes / 4): a block is block_size consecutive slots,
one contiguous run of block_elems = block_size * row_words words in each of the planes = layers * 2 * KVH
planes, whatever the type. Host pool: pinned memory, block-major [num_blocks, planes, block_elems],
so a parked block is one contiguous piece and a run of host slots one copy:

    park:    pool --gather_kv_blocks--> device staging [n, planes, block_elems] --DtoH per run--> host
    restore: host --HtoD per run--> device staging --scatter_kv_blocks--> pool

These run on the backend's copy stream, ordered after the compute stream's work, and nothing waits for them on
the host: the backend's compute stream waits on the copy stream (cuStreamWaitEvent) when a transfer ends, and
ModelRunner makes each stage's compute stream wait on the mover's `move_fence()` event, so the next step runs
after the moves in device order. Only a CPU access to host slots (the disk tier) synchronises first.
"""
from __future__ import annotations

import bisect
from dataclasses import replace

import numpy as np

from engine.backends.cuda.device import PinnedBuffer
from engine.kv import KVLayout

STAGING_BLOCKS = 64  # blocks moved per gather/scatter round (bounds the device staging buffer)


def planes_of(layout: KVLayout) -> int:
    return layout.n_layers * 2 * layout.n_kv_heads


def row_words(layout: KVLayout) -> int:
    """32-bit words of one pool row (the block-move kernels' `hd`)."""
    row_bytes = layout.type.row_bytes(layout.head_dim)
    assert row_bytes % 4 == 0, f"--kv-type {layout.kv_type} rows of head_dim {layout.head_dim} are not whole words"
    return row_bytes // 4


def block_bytes(layout: KVLayout) -> int:
    """One block of every plane: the layout's own figure (engine/kv.py owns it), in whole words."""
    assert planes_of(layout) * layout.block_size * row_words(layout) * 4 == layout.bytes_per_block
    return layout.bytes_per_block


class KVPlanes:
    """Addresses of a device K/V pool's planes (layer, K or V, head) within one segment of `seg_slots` token
    rows: the fixed pool is one segment, the elastic pool (cuda/kv_elastic.py) repeats the layout per segment.
    Needs `ptr`, `layout`, `seg_slots` and `row_words`."""

    def _plane_bytes(self) -> int:
        return self.seg_slots * self.row_words * 4

    def layer_k(self, layer: int) -> int:
        return self.ptr + (layer * 2) * self.layout.n_kv_heads * self._plane_bytes()

    def layer_v(self, layer: int) -> int:
        return self.ptr + (layer * 2 + 1) * self.layout.n_kv_heads * self._plane_bytes()


class CudaKVPool(KVPlanes):
    """The device pool of one stage, one segment of every slot (an arena allocation, fixed in size).

    `layer_k(l)` / `layer_v(l)` are the pool_layer_k/v kernel arguments; `seg_slots` and `seg_rows` the kernels'
    num_slots and seg_rows (docs/CUDA_KERNELS.md: slots of one segment, rows from one segment to the next;
    kv_elastic.ElasticKVPool has several segments)."""

    def __init__(self, backend, layout: KVLayout):
        self.layout = layout
        self.planes = planes_of(layout)
        self.row_words = row_words(layout)
        self.block_elems = layout.block_size * self.row_words  # words, as the block-move kernels count
        self.seg_slots, self.seg_rows = layout.num_slots, 0  # one segment: seg_rows is never used
        self.storage = backend.upload_zeros(layout.total_bytes, f"KV pool of {layout.num_blocks} blocks")
        self.ptr = self.storage.ptr

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def resize(self, num_blocks: int, caller=None) -> None:
        """A fixed pool keeps its memory when the cache's pool shrinks (as numpy does off Linux)."""


class CudaHostPool:
    """Pinned host blocks in segments, block-major [n, layers, 2, KVH, B, hd] each; a segment is pinned (and so
    committed: cuMemHostAlloc pins every page) when `grow` adds it, never before its slots are granted."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.block_bytes = block_bytes(layout)
        self._starts: list[int] = []
        self._buffers: list[PinnedBuffer] = []
        self._num_blocks = 0
        self.grow(layout.num_blocks)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers)

    def grow(self, num_blocks: int) -> None:
        if num_blocks <= self._num_blocks:
            return
        self._buffers.append(PinnedBuffer(self.block_bytes * (num_blocks - self._num_blocks)))
        self._starts.append(self._num_blocks)
        self._num_blocks = num_blocks
        lay = self.layout
        self.layout = replace(lay, num_blocks=num_blocks)

    def _segment(self, slot: int) -> int:
        assert 0 <= slot < self._num_blocks, f"host slot {slot} is not committed ({self._num_blocks} are)"
        return bisect.bisect_right(self._starts, slot) - 1

    def address(self, slot: int) -> int:
        s = self._segment(slot)
        return self._buffers[s].ptr + (slot - self._starts[s]) * self.block_bytes

    def segment_end(self, slot: int) -> int:
        """First slot after the segment holding `slot` (a run of slots is one copy only inside a segment)."""
        s = self._segment(slot)
        return self._starts[s + 1] if s + 1 < len(self._starts) else self._num_blocks

    def block(self, slot: int) -> np.ndarray:
        """View [layers, 2, KVH, B, row] of one host slot, in the layout's storage dtype."""
        lay, s = self.layout, self._segment(slot)
        shape = (lay.n_layers, 2, lay.n_kv_heads, lay.block_size, lay.row_elems)
        return self._buffers[s].view(np.dtype(lay.dtype), shape, (slot - self._starts[s]) * self.block_bytes)


def runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """(position in the list, first index, count) of maximal runs of consecutive indices."""
    out: list[tuple[int, int, int]] = []
    for i, value in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == value and out[-1][0] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, value, 1))
    return out


def host_runs(host: CudaHostPool, slots: list[int]) -> list[tuple[int, int, int]]:
    """`runs` of host slots, cut where a segment ends (slots of two segments are not one address range)."""
    out = []
    for first, slot, count in runs(slots):
        while count:
            n = min(count, host.segment_end(slot) - slot)
            out.append((first, slot, n))
            first, slot, count = first + n, slot + n, count - n
    return out


def chunks(pairs: list[tuple[int, int]], size: int = STAGING_BLOCKS):
    for i in range(0, len(pairs), size):
        yield pairs[i : i + size]


class KVTransfers:
    """Block copies of one backend: copy-on-write, park, restore, and one-block reads/writes (disk tier)."""

    def __init__(self, backend):
        self.backend = backend
        self.device = backend.device

    def copy_blocks(self, pool: CudaKVPool, pairs: list[tuple[int, int]]) -> None:
        with self.backend.on_copy_stream():
            self._copy(pool, pairs)

    def park(self, pool: CudaKVPool, host: CudaHostPool, pairs: list[tuple[int, int]]) -> None:
        with self.backend.on_copy_stream():
            self._park(pool, host, pairs)

    def restore(self, host: CudaHostPool, pool: CudaKVPool, pairs: list[tuple[int, int]]) -> None:
        with self.backend.on_copy_stream():
            self._restore(host, pool, pairs)

    def _copy(self, pool: CudaKVPool, pairs: list[tuple[int, int]]) -> None:
        b = self.backend
        for part in chunks(pairs, 4096):
            src = b.index_array(np.array([s for s, _ in part], dtype=np.int32))
            dst = b.index_array(np.array([d for _, d in part], dtype=np.int32))
            b.launch("copy_kv_blocks_f32", pool=pool.ptr, src_blocks=src, dst_blocks=dst, n_pairs=len(part),
                     planes=pool.planes, num_slots=pool.seg_slots, block_elems=pool.block_elems,
                     hd=pool.row_words)

    def _park(self, pool: CudaKVPool, host: CudaHostPool, pairs: list[tuple[int, int]]) -> None:
        """(device block, host slot) pairs: gather on the device, then one DtoH copy per run of host slots."""
        b, nbytes = self.backend, host.block_bytes
        staging = b.empty((min(len(pairs), STAGING_BLOCKS) * nbytes // 4,))
        for part in chunks(pairs):
            blocks = b.index_array(np.array([d for d, _ in part], dtype=np.int32))
            self._kernel("gather_kv_blocks_f32", staging, pool, blocks, len(part))
            for first, slot, count in host_runs(host, [h for _, h in part]):
                self.device.dtoh(host.address(slot), staging.ptr + first * nbytes, count * nbytes,
                                 b.current_stream)
        # No wait: the next chunk's gather into staging is stream-ordered after these copies, and a CPU read
        # of the host slots (read_block, write_block) first waits for the copy stream.

    def _restore(self, host: CudaHostPool, pool: CudaKVPool, pairs: list[tuple[int, int]]) -> None:
        """(host slot, device block) pairs: one HtoD copy per run of host slots, then scatter on the device."""
        b, nbytes = self.backend, host.block_bytes
        staging = b.empty((min(len(pairs), STAGING_BLOCKS) * nbytes // 4,))
        for part in chunks(pairs):
            for first, slot, count in host_runs(host, [h for h, _ in part]):
                self.device.htod(staging.ptr + first * nbytes, host.address(slot), count * nbytes,
                                 b.current_stream)
            blocks = b.index_array(np.array([d for _, d in part], dtype=np.int32))
            self._kernel("scatter_kv_blocks_f32", staging, pool, blocks, len(part))

    def read_block(self, pool, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) [layers, KVH, block_size, row] host copies of one block of the device or host pool (stored
        rows: int8 rows end in their scales)."""
        if isinstance(pool, CudaHostPool):
            self._wait_for_copies()
            data = pool.block(block)
        else:
            b, lay = self.backend, pool.layout
            staging = b.empty((pool.planes * pool.block_elems,))
            self._kernel("gather_kv_blocks_f32", staging, pool, b.index_array(np.array([block], np.int32)), 1)
            data = b.to_host(staging).view(lay.dtype).reshape(lay.n_layers, 2, lay.n_kv_heads, lay.block_size,
                                                              lay.row_elems)
        return data[:, 0].copy(), data[:, 1].copy()

    def write_block(self, pool, block: int, k: np.ndarray, v: np.ndarray) -> None:
        packed = np.ascontiguousarray(np.stack([k, v], axis=1), dtype=pool.layout.dtype)  # [layers, 2, KVH, B, row]
        if isinstance(pool, CudaHostPool):
            self._wait_for_copies()
            pool.block(block)[...] = packed
            return
        b = self.backend
        staging = b.upload_activation(packed.reshape(-1).view(np.float32))  # the words the kernels move
        self._kernel("scatter_kv_blocks_f32", staging, pool, b.index_array(np.array([block], np.int32)), 1)

    def _wait_for_copies(self) -> None:
        """The CPU is about to touch host slots that parks or restores queued on the copy stream may use:
        a host synchronisation, on the disk tier's paths (and a park/restore swap) only."""
        self.backend.synchronize_stream(self.backend.copy_stream)

    def _kernel(self, kernel: str, staging, pool: CudaKVPool, blocks, n: int) -> None:
        self.backend.launch(kernel, staging=staging, pool=pool.ptr, blocks=blocks, n=n, planes=pool.planes,
                            num_slots=pool.seg_slots, block_elems=pool.block_elems, hd=pool.row_words)
