"""The elastic device KV pool (--kv-cache-max-mib on CUDA): every reserved block id has an address for good;
physical memory backs only the ids the conversation cache's pool holds now (scheduler/cache/device_pool.py).

Why segments. The fixed pool is plane-major, [layers, 2, KVH, num_slots, row]: one block's bytes are
layers * 2 * KVH runs of block_size rows, each a whole plane (num_slots rows) apart. Backing "blocks 0..n" in
that layout would need a physical chunk per plane per step of growth (thousands of chunks, each at least the
2 MiB granularity, for a large model). So this pool is segment-major: segments of SEGMENT_BLOCKS blocks, each
laid out as a small fixed pool [layers, 2, KVH, seg_slots, row], one after another:

    address:  base                                                                          base + reserved
              | segment 0 (blocks 0..63)      | segment 1 (blocks 64..127)    | ...  | segment S-1  |
              | L0 K h0 | L0 K h1 | ... | L_last V h_last |   (each run seg_slots rows of the --kv-type)
    mapped:   |=== chunk 0 ===|=== chunk 1 ===|=== chunk 2 ===|                 (vmm.VirtualRange)

Blocks 0..n-1 are then the prefix base .. base + ceil(n / SEGMENT_BLOCKS) * segment_bytes, and a chunk is the
segment's bytes rounded up to the allocation granularity, so a segment is one chunk, or a few segments share
one for small models. Every --kv-type maps the same way: a row (f32, f16, or int8 values + their float32 scale)
lives inside its segment, and a block's scales travel with its rows. The kernels take `num_slots` = seg_slots
and `seg_rows` = planes * seg_slots (docs/CUDA_KERNELS.md); a slot's address never depends on how much is
mapped, so block ids and per-layer pointers stay valid through every grow and shrink, and graphs captured on
this pool stay valid too.
"""
from __future__ import annotations

import logging

from engine.backends.cuda.kv import KVPlanes, planes_of, row_words
from engine.backends.cuda.vmm import VirtualRange
from engine.kv import KVLayout
from engine.units import MIB

log = logging.getLogger("strata.cuda")
SEGMENT_BLOCKS = 64  # blocks per layout segment (the cache's growth segment is its own fact, device_pool.py)


class ElasticKVPool(KVPlanes):
    """A stage's device pool over `layout.num_blocks` reserved ids, `mapped_blocks` of them backed at first.

    Same kernel-facing attributes as kv.CudaKVPool (ptr, planes, row_words, block_elems, seg_slots,
    seg_rows, layer_k / layer_v). `resize(n)` backs ids 0..n-1 (and what shares their last chunk)."""

    def __init__(self, backend, layout: KVLayout, mapped_blocks: int, seg_blocks: int = SEGMENT_BLOCKS):
        self.layout = layout
        self.backend = backend
        self.planes = planes_of(layout)
        self.row_words = row_words(layout)
        self.block_elems = layout.block_size * self.row_words
        self.seg_blocks = seg_blocks
        self.seg_slots = seg_blocks * layout.block_size
        self.seg_rows = self.planes * self.seg_slots
        self.segment_bytes = seg_blocks * layout.bytes_per_block
        num_segments = -(-layout.num_blocks // seg_blocks)
        self.vmm = VirtualRange(backend.device, num_segments * self.segment_bytes, self.segment_bytes)
        self.ptr = self.vmm.base
        self.num_blocks = 0  # ids backed now (the cache's pool size)
        self.resize(mapped_blocks)  # on the creating backend's stream

    @property
    def nbytes(self) -> int:
        """Physical bytes backing the pool now."""
        return self.vmm.mapped_bytes

    def bytes_for(self, num_blocks: int) -> int:
        """The prefix of the range that ids 0..num_blocks-1 live in: whole segments."""
        return -(-num_blocks // self.seg_blocks) * self.segment_bytes

    def resize(self, num_blocks: int, caller=None) -> None:
        """Back ids 0..num_blocks-1; the bytes of ids still backed are untouched. A shrink first waits for the
        device's queued work (a relocation copy or a step may still read the ids it unmaps). New chunks are
        zeroed on the caller's stream (a backend: the stage's mover) before this returns, as a fixed pool and
        numpy's released pages read as zeros; growth is rare (a segment at a time), so the wait is cheap."""
        assert 0 < num_blocks <= self.layout.num_blocks, f"{num_blocks} blocks outside 1..{self.layout.num_blocks}"
        if self.bytes_for(num_blocks) < self.vmm.mapped_bytes:
            self.backend.device.synchronize_context()
        before = self.vmm.mapped_bytes
        self.vmm.map_to(self.bytes_for(num_blocks))
        self.num_blocks = num_blocks
        if self.vmm.mapped_bytes > before:
            caller = caller or self.backend
            caller.device.fill_u32(self.ptr + before, 0, (self.vmm.mapped_bytes - before) // 4, caller.stream)
            caller.synchronize_stream(caller.stream)
        if self.vmm.mapped_bytes != before:
            log.info("cuda KV pool: %d blocks backed by %.1f MiB (%d chunks of %.1f MiB; %d ids reserved)",
                     num_blocks, self.vmm.mapped_bytes / MIB, self.vmm.mapped_bytes // self.vmm.chunk_bytes,
                     self.vmm.chunk_bytes / MIB, self.layout.num_blocks)

    def close(self) -> None:
        self.backend.device.synchronize_context()
        self.vmm.close()
