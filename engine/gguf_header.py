"""A GGUF file's header (metadata and tensor infos) read straight into Python values, and its tensor data mapped.

Why not gguf.GGUFReader: it keeps one numpy memmap view per part of every field, two per string of an
array, so a 262K-token vocabulary (gemma3) became ~1M small memmap objects: opening gemma3-270m took
713 MiB of RSS before any weight was touched, and the peak of `strata serve` was twice its steady state
(measured with /proc/self/status, docs/BENCHMARKS.md). This reads the same format (GGUF v2 and v3, the
spec in ggml/docs/gguf.md) with struct, numeric arrays with one np.frombuffer each, and maps the tensor
data once with np.memmap; the values are what `ReaderField.contents()` gives (str, int, float, bool,
lists of them), and tensor arrays are shaped as GGUFReader shapes them.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # b"GGUF" little-endian
_STRING, _ARRAY = 8, 9
# value type id -> (struct code, numpy dtype) of the fixed-size types
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_PLAIN_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


class TensorInfo(NamedTuple):
    """One tensor as GGUFReader's ReaderTensor describes it (the fields this engine reads)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims innermost-first, as stored
    n_bytes: int
    data: np.ndarray  # read-only view of the mapped file: plain dtypes [reversed dims], else uint8 byte shape


class _Cursor:
    def __init__(self, buf: bytes | memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, code: str):
        (value,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return str(self.buf[self.pos - n : self.pos], encoding="utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _SCALARS and item_kind != 7:
                dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder("<")
                values = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += values.nbytes
                return values.tolist()
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind][0])


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(metadata {key: value}, tensors {name: TensorInfo}) of a GGUF file; ValueError if it is not one."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    if len(data) < 24 or cur.scalar("<I") != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    fields = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        infos.append((name, dims, GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"duplicated tensor {name}")
        tensors[name] = _tensor(data, name, dims, kind, start + offset)
    return fields, tensors


def _tensor(data: np.ndarray, name: str, dims: list[int], kind: GGMLQuantizationType, offset: int) -> TensorInfo:
    n_elems = int(np.prod(dims))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    n_bytes = n_elems * type_size // block_size
    np_dims = tuple(reversed(dims))
    raw = data[offset : offset + n_bytes]
    if len(raw) != n_bytes:
        raise ValueError(f"tensor {name} runs past the end of the file")
    if kind in _PLAIN_DTYPES:
        array = raw.view(_PLAIN_DTYPES[kind]).reshape(np_dims)
    else:
        array = raw.reshape(quant_shape_to_byte_shape(np_dims, kind))
    return TensorInfo(name, kind, np.array(dims, dtype=np.uint64), n_bytes, array)
