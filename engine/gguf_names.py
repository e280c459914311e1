"""What a GGUF file's name says: its quant tag, whether it is one part of a split model, and which file of a
folder or repository a quant tag picks.

The rules are llama.cpp's (common/download.cpp), so `hf:OWNER/REPO:QUANT` here picks the file that
`llama-server -hf OWNER/REPO:QUANT` picks:

* a split model's parts are named ``<prefix>-00001-of-00003.gguf`` .. ``-00003-of-00003.gguf`` (what
  ``llama-gguf-split`` and gguf's writer produce); only the first part is ever picked, the rest follow it;
* the quant tag is the last ``-`` or ``.`` separated word of the name (``Qwen2.5-0.5B-Instruct-Q4_K_M``);
* a tag picks the first model file whose path contains ``TAG-`` or ``TAG.`` (any case); no tag tries Q4_K_M,
  then Q8_0, then the first model file;
* files that are not models (multimodal projectors, importance matrices, draft/MTP heads) are never picked.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama-server's choice when no tag is given
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass(frozen=True)
class SplitName:
    """A GGUF path read as ``<prefix>[-NNNNN-of-MMMMM].gguf``: part ``index`` (1-based) of ``count``."""

    prefix: str
    tag: str  # the quant tag, upper case ("" when the name has none)
    index: int = 1
    count: int = 1

    def part_path(self, index: int) -> str:
        """The path of part ``index`` of the same split model."""
        return f"{self.prefix}-{index:05d}-of-{self.count:05d}.gguf" if self.count > 1 else f"{self.prefix}.gguf"


def split_name(path: str) -> SplitName | None:
    """The split reading of a ``.gguf`` path, or None for a path without that suffix."""
    if not path.lower().endswith(".gguf"):
        return None
    prefix, index, count = path[: -len(".gguf")], 1, 1
    if m := _SPLIT.match(prefix):
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    tag = m.group(1).upper() if (m := _TAG.search(prefix)) else ""
    return SplitName(prefix, tag, index, count)


def is_model_file(path: str) -> bool:
    """A .gguf file that holds a model (not a projector, importance matrix or draft head)."""
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(word in name for word in _NOT_MODELS)


def pick_model_file(paths: Iterable[str], tag: str = "") -> str | None:
    """The first part of the model file ``tag`` picks among ``paths`` (llama-server's rule), or None."""
    candidates = [p for p in paths if is_model_file(p) and split_name(p).index == 1]
    for wanted in ([tag] if tag else list(DEFAULT_TAGS)):
        pattern = re.compile(re.escape(wanted) + r"[.-]", re.IGNORECASE)
        for path in candidates:
            if pattern.search(path):
                return path
    if not tag and candidates:
        return candidates[0]
    return None


def split_parts(paths: Iterable[str], first: str) -> list[str]:
    """Every part of the split model whose first part is ``first``, in order (just ``[first]`` when unsplit).

    Raises ValueError naming the parts that are missing from ``paths``.
    """
    name = split_name(first)
    if name is None or name.count == 1:
        return [first]
    wanted = [name.part_path(i) for i in range(1, name.count + 1)]
    missing = sorted(set(wanted) - set(paths))
    if missing:
        raise ValueError(f"{first} is part 1 of {name.count} of a split model, but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing")
    return wanted


def model_files_listing(paths: Iterable[str]) -> str:
    """The model files among ``paths`` (first parts only, with their part counts) as one line for an error."""
    shown = []
    for p in paths:
        if is_model_file(p) and (name := split_name(p)).index == 1:
            shown.append(p if name.count == 1 else f"{p} (+{name.count - 1} parts)")
    return ", ".join(shown) or "no .gguf model files"
