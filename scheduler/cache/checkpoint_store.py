"""The bytes of recurrent-state checkpoints, per tier, apart from the K/V blocks they ride with.

A checkpoint is the recurrent state of a hybrid model (engine/recurrent_state.py) after token `k` of a
cached block; it is named (block digest, k). The conversation cache decides where each one is (always
the tier of its block, scheduler/cache/prefix_cache.py); this store only holds the bytes where it is told:

    device: {(digest, k): state}     host: {(digest, k): state}     disk: <dir>/<digest>.<k>.state

On numpy, device and host are both process memory, so a park or restore moves a reference from one
dict to the other; what matters is that every checkpoint is in exactly one tier, as its block is. A
checkpoint in a memory tier may have a file too (`copies`: written behind, or kept when it was loaded
from disk), as a written-behind block does: it spills without a write and a restart finds it. A
disk file holds a header (magic, format version, cache key, digest, k, state shape), the float32 state
and a checksum of all of it; it is written under a temporary name and renamed into place.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path

import numpy as np

log = logging.getLogger("strata.cache.disk")
_MAGIC = b"STRATACK"
_VERSION = 1
_HEADER = struct.Struct("<8sI16s16sI3I")  # magic, version, cache key, digest, k, state shape (3 dims)
_CHECKSUM_BYTES = 16
Key = tuple[bytes, int]  # (block digest, tokens of the block the state is after)


class CheckpointStore:
    """Checkpoint bytes in the device and host dicts and, with a directory, in disk files."""

    def __init__(self, shape: tuple[int, ...] = (), disk_dir: str | Path | None = None, key: bytes = b""):
        self.shape = tuple(shape)
        self.tiers: dict[str, dict[Key, np.ndarray]] = {"device": {}, "host": {}}
        self.dir = Path(disk_dir) if disk_dir is not None else None
        self.key = key.ljust(16, b"\0")[:16]
        self.on_disk: set[Key] = set()  # disk-tier checkpoints (their only copy is the file)
        self.copies: set[Key] = set()  # checkpoints in a memory tier whose file is on disk too
        self.fail_writes = False  # tests: a disk write that fails

    @property
    def state_bytes(self) -> int:
        return int(np.prod(self.shape)) * 4 if self.shape else 0

    def count(self, tier: str) -> int:
        return len(self.on_disk) if tier == "disk" else len(self.tiers[tier])

    def nbytes(self, tier: str) -> int:
        return self.count(tier) * self.state_bytes

    @property
    def num_files(self) -> int:
        """Checkpoint files this run keeps: the disk tier's and the memory tiers' copies."""
        return len(self.on_disk) + len(self.copies)

    # -- memory tiers --------------------------------------------------------------------------------
    def put(self, tier: str, key: Key, state: np.ndarray) -> None:
        assert state.shape == self.shape, f"checkpoint shape {state.shape}, expected {self.shape}"
        self.tiers[tier][key] = np.array(state, dtype=np.float32, copy=True)

    def get(self, tier: str, key: Key) -> np.ndarray | None:
        """A copy of the state (disk: read and verified; None when the file is missing or invalid)."""
        if tier == "disk":
            return self.read_file(key)
        return self.tiers[tier][key].copy()

    def move(self, key: Key, src: str, dst: str) -> None:
        self.tiers[dst][key] = self.tiers[src].pop(key)

    def delete(self, tier: str, key: Key) -> None:
        """Forget a checkpoint: its bytes in `tier` and its file (a disk one, or a memory tier's copy)."""
        if tier == "disk":
            self.on_disk.discard(key)
            self._unlink(key)
        else:
            del self.tiers[tier][key]
            self.drop_copy(key)

    def drop_copy(self, key: Key) -> None:
        """Delete the file of a memory-tier checkpoint (for room; it stays where it is)."""
        if key in self.copies:
            self.copies.discard(key)
            self._unlink(key)

    def _unlink(self, key: Key) -> None:
        if self.dir is not None:
            self._path(key).unlink(missing_ok=True)

    # -- disk ----------------------------------------------------------------------------------------
    def spill(self, key: Key, src: str) -> bool:
        """Memory tier -> disk; False (and the bytes dropped) when the write failed. A copy is not written
        again: its file becomes the checkpoint."""
        state = self.tiers[src].pop(key)
        if key in self.copies:
            self.copies.discard(key)
            self.on_disk.add(key)
            return True
        return self.write_file(key, state)

    def write_copy(self, key: Key, tier: str) -> bool:
        """Write the file of a memory-tier checkpoint, which stays there (write-behind); False: not written."""
        assert key not in self.copies and key in self.tiers[tier], f"{key} is no unsaved {tier} checkpoint"
        if not self.write_file(key, self.tiers[tier][key], index=False):
            return False
        self.copies.add(key)
        return True

    def keep_as_copy(self, key: Key, state: np.ndarray) -> None:
        """A disk checkpoint loaded to the device: its state goes there, its file stays as the copy."""
        self.on_disk.discard(key)
        self.put("device", key, state)
        self.copies.add(key)

    def write_file(self, key: Key, state: np.ndarray, index: bool = True) -> bool:
        """Write one checkpoint file; `index` False (the shutdown flush): the checkpoint stays in its
        memory tier for this run and the file is for the next start."""
        if self.dir is None or self.fail_writes:
            return False
        digest, k = key
        body = _HEADER.pack(_MAGIC, _VERSION, self.key, digest, k, *self.shape)
        body += np.ascontiguousarray(state, dtype="<f4").tobytes()
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(body + hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("could not write a state checkpoint to disk: %s", exc, extra={"fields": {"error": str(exc)}})
            return False
        if index:
            self.on_disk.add(key)
        return True

    def read_file(self, key: Key) -> np.ndarray | None:
        try:
            found, state = self._parse(self._path(key).read_bytes())
        except (OSError, ValueError, struct.error) as exc:
            log.warning("state checkpoint file unusable, recomputing instead: %s", exc,
                        extra={"fields": {"error": str(exc)}})
            return None
        return state if found == key else None

    def scan(self) -> list[Key]:
        """Every valid checkpoint file (at start-up); invalid ones are logged and removed."""
        if self.dir is None:
            return []
        keys = []
        for path in sorted(self.dir.glob("*.state")):
            try:
                key, _ = self._parse(path.read_bytes())
                if path != self._path(key):
                    raise ValueError("file name does not match its digest")
                keys.append(key)
            except (OSError, ValueError, struct.error) as exc:
                log.warning("ignoring checkpoint file %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
        self.on_disk, self.copies = set(keys), set()
        return keys

    def _path(self, key: Key) -> Path:
        return self.dir / f"{key[0].hex()}.{key[1]}.state"

    def _parse(self, raw: bytes) -> tuple[Key, np.ndarray]:
        if len(raw) < _HEADER.size + _CHECKSUM_BYTES:
            raise ValueError("truncated file")
        body, checksum = raw[:-_CHECKSUM_BYTES], raw[-_CHECKSUM_BYTES:]
        if hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest() != checksum:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        magic, version, key, digest, k, *shape = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION or key != self.key:
            raise ValueError("not a checkpoint of this model and format")
        if tuple(shape) != self.shape or len(body) != _HEADER.size + self.state_bytes:
            raise ValueError(f"state of shape {tuple(shape)}, the model's is {self.shape}")
        state = np.frombuffer(raw, dtype="<f4", count=self.state_bytes // 4, offset=_HEADER.size)
        return (digest, int(k)), state.reshape(self.shape).astype(np.float32)
