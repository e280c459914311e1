"""Where the expert cache's device slots live: pieces of the device arena, or one range mapped like the KV pool.

    arena   each slot its own piece of the device arena (`Device.reserve`): a fixed KV pool's case, where the
            arena holds the pool too, and tools without a server (slots made at the first step)
    vmm     slots 0 .. n-1 at base + slot * slot_bytes in one reserved address range (cuda.vmm.VirtualRange),
            backed by chunks from outside the arena: an elastic KV pool's case. The KV pool's chunks and these
            come out of the same room (--kv-cache-mib MIN:MAX's MAX, left outside the arena), and the memory
            admission hands that room to one or the other (cuda/expert_cache/budget.py), so a slot unmapped
            here is memory the KV pool can map next

Both keep slot ids 0 .. n-1 (slots.ExpertSlots moves residents down before a shrink), so a
shrink always removes the top ids. `bytes_for(n)` is what n slots take of the device budget (vmm: whole chunks).
Not thread-safe: the cache calls them under its lease, between steps.
"""
from __future__ import annotations

import logging

from engine.backends.cuda.vmm import VirtualRange
from engine.units import MIB

log = logging.getLogger("strata.expert_cache")


class ArenaSlotMemory:
    """Slots as separate pieces of the device arena."""

    kind = "arena"

    def __init__(self, device, slot_bytes: int):
        self.device = device
        self.slot_bytes = slot_bytes
        self._address: list[int] = []  # slot id -> device address

    @property
    def num_slots(self) -> int:
        return len(self._address)

    def bytes_for(self, num_slots: int) -> int:
        return num_slots * self.slot_bytes

    def slots_within(self, nbytes: int) -> int:
        """The most slots whose bytes_for fits nbytes."""
        return nbytes // self.slot_bytes

    def address(self, slot: int) -> int:
        return self._address[slot]

    def resize(self, num_slots: int) -> int:
        """Back slots 0 .. num_slots-1; a growth stops where the arena is full. Returns the slots backed."""
        while len(self._address) < num_slots:
            address = self.device.reserve(self.slot_bytes)
            if address is None:
                if not self._address:
                    raise MemoryError(f"no GPU memory for one expert slot ({self.slot_bytes / MIB:.2f} MiB)")
                log.warning("expert cache: the arena is full at %d of %d slots", len(self._address), num_slots)
                break
            self._address.append(address)
        while len(self._address) > num_slots:
            self.device.unreserve(self._address.pop())
        return len(self._address)

    def close(self) -> None:
        self.resize(0)


class VmmSlotMemory:
    """Slots in one virtual range of max_slots slots, mapped chunk by chunk from the top."""

    kind = "vmm"

    def __init__(self, device, slot_bytes: int, max_slots: int):
        self.device = device
        self.slot_bytes = slot_bytes
        # Chunks of the allocation granularity (2 MiB on an H100): the budget rounds the slots up by less than
        # a chunk; a few thousand cuMemCreate chunks for a 30B MoE's cache are cheap next to its copies.
        self.vmm = VirtualRange(device, max_slots * slot_bytes, 1)
        self.max_slots = max_slots
        self.num_slots = 0

    def bytes_for(self, num_slots: int) -> int:
        chunk = self.vmm.chunk_bytes
        return -(-num_slots * self.slot_bytes // chunk) * chunk

    def slots_within(self, nbytes: int) -> int:
        return min(self.max_slots, nbytes // self.vmm.chunk_bytes * self.vmm.chunk_bytes // self.slot_bytes)

    def address(self, slot: int) -> int:
        assert slot < self.num_slots, f"slot {slot} of {self.num_slots} mapped"
        return self.vmm.base + slot * self.slot_bytes

    def resize(self, num_slots: int) -> int:
        """Map (or unmap, from the top) the chunks slots 0 .. num_slots-1 need; the caller has waited for
        every kernel and copy reading a slot a shrink unmaps. Returns the slots backed: a growth stops where
        the driver has no chunk (MemoryError only when not one slot is backed)."""
        assert 0 <= num_slots <= self.max_slots, f"{num_slots} expert slots outside 0 .. {self.max_slots}"
        try:
            self.vmm.map_to(self.bytes_for(num_slots))
            self.num_slots = num_slots
        except MemoryError as error:  # a growth the driver cannot back: keep what was mapped
            self.num_slots = min(num_slots, self.vmm.mapped_bytes // self.slot_bytes)
            if not self.num_slots:
                raise
            log.warning("expert cache: %d of %d slots mapped (%s)", self.num_slots, num_slots, error)
        return self.num_slots

    def close(self) -> None:
        self.vmm.close()
        self.num_slots = 0
