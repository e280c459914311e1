"""The disk tier of the conversation cache: one file per KV block, named by its chain digest.

Files live under `<--conversation-cache-dir>/<cache key>/`, where the cache key is a digest of everything
that changes the KV bytes (the model file's name, size and content digest, the backend, the KV layout:
block size, layers, KV heads, head dim, K/V type). A block file holds a header (magic, format version, cache key,
digest, parent digest, tokens) and the K and V bytes, followed by a checksum of all of it. At start-up
the index is rebuilt from the files; a file that is truncated, corrupt or for another model is ignored
and logged, never loaded. Writes go to a temporary name and are renamed into place, so a crash leaves
either the old file or none.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("strata.cache.disk")
_MAGIC = b"STRATAKV"
_VERSION = 1
_HEADER = struct.Struct("<8sI16s16s16sI")  # magic, version, cache key, digest, parent digest, n_tokens
_CHECKSUM_BYTES = 16


@dataclass(frozen=True)
class DiskEntry:
    digest: bytes
    parent_digest: bytes
    tokens: tuple[int, ...]


def model_file_identity(path: str | Path) -> str:
    """Name, size and digests of the head and tail of a model file: cheap, and changes with its bytes."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"{path.name}:{size}:{digest.hexdigest()}"


def cache_key(model_identity: str, layout_fields: tuple) -> bytes:
    """Digest of everything that changes the bytes of a KV block."""
    text = repr((model_identity, layout_fields)).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"strata-kvdisk").digest()


class DiskTier:
    """Block files in one directory for one cache key, with a byte budget (`capacity_blocks`)."""

    def __init__(self, root: str | Path, key: bytes, block_shape: tuple[int, ...], dtype: str,
                 capacity_blocks: int):
        self.dir = Path(root) / key.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.block_shape = block_shape  # shape of K (and of V) for one block, all layers
        self.dtype = np.dtype(dtype)
        self.capacity_blocks = capacity_blocks

    @classmethod
    def for_layout(cls, root: str | Path, model_identity: str, backend_name: str, layout,
                   capacity_bytes: int) -> "DiskTier":
        """The tier of one model file, backend and KV layout (engine/kv.KVLayout of the whole model).

        The key covers every field that changes a block's bytes, the K/V type included, so a restart
        with another --kv-type (or backend: numpy and cuda may differ in the last bits) uses a directory
        of its own and never reads these bytes."""
        key = cache_key(model_identity, (backend_name, layout.block_size, layout.n_layers, layout.n_kv_heads,
                                         layout.head_dim, layout.kv_type, layout.dtype, layout.row_elems))
        block_shape = (layout.n_layers, layout.n_kv_heads, layout.block_size, layout.row_elems)
        return cls(root, key, block_shape, layout.dtype, capacity_bytes // layout.bytes_per_block)

    def _path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}.kv"

    def write(self, entry: DiskEntry, k: np.ndarray, v: np.ndarray) -> None:
        """Store one block; raises OSError (disk full, unwritable) with nothing half-written left behind."""
        header = _HEADER.pack(_MAGIC, _VERSION, self.key, entry.digest, entry.parent_digest, len(entry.tokens))
        body = header + np.asarray(entry.tokens, dtype="<u4").tobytes()
        body += np.ascontiguousarray(k, dtype=self.dtype).tobytes() + np.ascontiguousarray(v, dtype=self.dtype).tobytes()
        checksum = hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest()
        path = self._path(entry.digest)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(body + checksum)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, digest: bytes) -> tuple[DiskEntry, np.ndarray, np.ndarray]:
        """Load one block, verifying it; raises ValueError when the file is not a valid block of this cache."""
        raw = self._path(digest).read_bytes()
        entry, offset = self._parse_header(raw)
        if entry.digest != digest:
            raise ValueError("block file holds another digest")
        n = int(np.prod(self.block_shape)) * self.dtype.itemsize
        k = np.frombuffer(raw, dtype=self.dtype, count=n // self.dtype.itemsize, offset=offset)
        v = np.frombuffer(raw, dtype=self.dtype, count=n // self.dtype.itemsize, offset=offset + n)
        return entry, k.reshape(self.block_shape), v.reshape(self.block_shape)

    def delete(self, digest: bytes) -> None:
        self._path(digest).unlink(missing_ok=True)

    def scan(self) -> list[DiskEntry]:
        """Every valid block file's entry; invalid files are logged and removed."""
        entries = []
        for path in sorted(self.dir.glob("*.kv")):
            try:
                entry, _ = self._parse_header(path.read_bytes())
                if path.name != f"{entry.digest.hex()}.kv":
                    raise ValueError("file name does not match its digest")
                entries.append(entry)
            except (OSError, ValueError, struct.error) as exc:
                log.warning("ignoring cache file %s: %s", path.name, exc,
                            extra={"fields": {"file": str(path), "reason": str(exc)}})
                path.unlink(missing_ok=True)
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        return entries

    def _parse_header(self, raw: bytes) -> tuple[DiskEntry, int]:
        n = int(np.prod(self.block_shape)) * self.dtype.itemsize
        if len(raw) < _HEADER.size + _CHECKSUM_BYTES:
            raise ValueError("truncated file")
        body, checksum = raw[:-_CHECKSUM_BYTES], raw[-_CHECKSUM_BYTES:]
        if hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest() != checksum:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        magic, version, key, digest, parent, n_tokens = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"not a strata KV block file of format {_VERSION}")
        if key != self.key:
            raise ValueError("written for another model or KV layout")
        offset = _HEADER.size + 4 * n_tokens
        if len(body) != offset + 2 * n:
            raise ValueError("size does not match the KV layout")
        tokens = tuple(int(t) for t in np.frombuffer(raw, dtype="<u4", count=n_tokens, offset=_HEADER.size))
        return DiskEntry(digest, parent, tokens), offset
