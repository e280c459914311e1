"""Reading a GGUF file: metadata as plain Python values, tensors dequantised to float32 or as raw rows.

Dequantisation is delegated to the `gguf` package (the reference Python implementation maintained next to
llama.cpp), so every quant type it knows is supported; anything else fails at open time, naming the tensor.
"""
from __future__ import annotations

import functools
import logging
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.gguf_header import TensorInfo, read_gguf
from engine.gguf_names import split_name

log = logging.getLogger("strata.gguf")

# Types stored as plain floats; everything else must have a dequantiser in the gguf package.
_PLAIN_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64}


@functools.cache
def supported_quant_types() -> frozenset[GGMLQuantizationType]:
    """All tensor types this engine can load: plain floats + every type gguf can dequantise, found through
    its public `dequantize` (one zero block each, ~5 ms once), which raises NotImplementedError for the rest."""
    return frozenset(_PLAIN_FLOAT_TYPES | {qtype for qtype, (_, type_size) in GGML_QUANT_SIZES.items()
                                           if _dequantizes(qtype, type_size)})


def _dequantizes(qtype: GGMLQuantizationType, type_size: int) -> bool:
    try:
        gguf_quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


class GGUFFile:
    """An opened GGUF file (memory-mapped, read-only), or a split model opened by its first part.

    `fields` maps every metadata key to a Python value (str, int, float, bool or list of them).
    `tensor(name)` returns the dequantised float32 array in numpy order ([rows, cols] = [out, in]).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:  # engine/gguf_header.py: gguf.GGUFReader's field parts cost gemma3-270m 713 MiB of RSS
            self.fields, self._tensors = read_split_gguf(self.path)
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self._check_tensor_types()

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self._tensors[name].tensor_type

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Numpy-order shape of a tensor, without reading its data."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def tensor_nbytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def tensor(self, name: str) -> np.ndarray:
        """Dequantised float32 copy of tensor `name`, shaped like numpy expects ([out, in] for matrices)."""
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} not found in {self.path.name}")
        t = self._tensors[name]
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64):
            data = np.asarray(t.data, dtype=np.float32)
        else:
            data = gguf_quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims innermost-first; numpy wants them outermost-first.
        return np.ascontiguousarray(data.reshape(self.tensor_shape(name)))

    def tensor_raw(self, name: str) -> tuple[GGMLQuantizationType, np.ndarray]:
        """(type, rows as stored): a uint8 view [rows, row_bytes] of the memory-mapped file, no copy.

        Row r holds output row r of an [out, in] matrix as whole quant blocks (or plain F32/F16 values),
        so row selections and permutations apply to these bytes as to the dequantised rows.
        """
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} not found in {self.path.name}")
        t = self._tensors[name]
        n_rows = self.tensor_shape(name)[0]
        data = np.asarray(t.data)
        return GGMLQuantizationType(t.tensor_type), data.view(np.uint8).reshape(n_rows, -1)

    def _check_tensor_types(self) -> None:
        supported = supported_quant_types()
        bad = [(n, t.tensor_type) for n, t in self._tensors.items() if t.tensor_type not in supported]
        if bad:
            listing = ", ".join(f"{n} ({_type_name(tt)})" for n, tt in bad[:5])
            raise ValueError(
                f"{self.path.name}: unsupported tensor type(s): {listing}"
                + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                + f". Supported: {', '.join(sorted(_type_name(s) for s in supported))}"
            )


def read_split_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """read_gguf of a whole model: for the first part of a split model (``split.count`` > 1, named
    ``<prefix>-00001-of-0000N.gguf``) the tensors of every part, each part mapped where it lies (no copy, no
    merged file); the metadata is the first part's. ValueError for a later part, a missing or foreign part."""
    fields, tensors = read_gguf(path)
    count = int(fields.get("split.count", 1))
    if count <= 1:
        return fields, tensors
    name = split_name(path.name)
    if int(fields.get("split.no", 0)) != 0 or name is None or name.count != count or name.index != 1:
        raise ValueError(f"part {int(fields.get('split.no', 0)) + 1} of a {count}-part split model: give the "
                         f"first part, named like <name>-00001-of-{count:05d}.gguf")
    for index in range(2, count + 1):
        part = path.with_name(name.part_path(index))
        if not part.is_file():
            raise ValueError(f"part {index} of {count} ({part.name}) is missing beside {path.name}")
        part_fields, part_tensors = read_gguf(part)
        if int(part_fields.get("split.no", -1)) != index - 1 or int(part_fields.get("split.count", 0)) != count:
            raise ValueError(f"{part.name} is not part {index} of {count} (its split.no / split.count say "
                             f"{part_fields.get('split.no')} / {part_fields.get('split.count')})")
        if dup := set(tensors) & set(part_tensors):
            raise ValueError(f"{part.name} repeats tensor(s) of earlier parts: {', '.join(sorted(dup)[:3])}")
        tensors.update(part_tensors)
    expected = int(fields.get("split.tensors.count", len(tensors)))
    if len(tensors) != expected:
        raise ValueError(f"the {count} parts hold {len(tensors)} tensors; split.tensors.count says {expected}")
    return fields, tensors


def _type_name(tensor_type: Any) -> str:
    return getattr(tensor_type, "name", str(tensor_type))
