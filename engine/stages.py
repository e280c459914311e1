"""A layer split: which consecutive layers each pipeline stage owns, and the KV pools that go with them.

`--layer-split 16,32` on a 48-layer model cuts it into stages [0, 16), [16, 32), [32, 48) (the values are
the first layer of every stage after the first, as in the seeds' launch lines). Stage 0 also embeds the
tokens, the last stage applies the final norm and output head. Each stage keeps the K/V of its own layers
in a pool of its own; every pool has the same number of blocks and the same block ids address all of
them, so one block of the conversation cache is the same id in every stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from engine.backends.base import Backend
from engine.kv import KVLayout


def split_layers(n_layers: int, cuts: Sequence[int]) -> list[range]:
    """Layer ranges of the stages given the cut points; no cuts = one stage of every layer.

    Raises ValueError naming the problem when the cuts are not strictly increasing inside (0, n_layers).
    """
    cuts = list(cuts)
    bounds = [0, *cuts, n_layers]
    for value in cuts:
        if not 0 < value < n_layers:
            raise ValueError(f"--layer-split {','.join(map(str, cuts))}: {value} is not a layer between 1 and "
                             f"{n_layers - 1} (the model has {n_layers} layers)")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"--layer-split {','.join(map(str, cuts))}: cut points must be strictly increasing")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass
class Stage:
    """One pipeline stage: its layers, the backend it computes on, and its share of the KV pools."""

    index: int
    layers: range
    backend: Backend
    layout: KVLayout  # this stage's device pool (n_layers = len(layers))
    kv_pool: Any
    host_pool: Any  # this stage's share of the host tier (grown on demand; 0 blocks without one)
    mover: Backend  # the handle block moves use, from the event loop's thread (backend.sibling())
    state_pool: Any = None  # hybrid models: recurrent states of this stage's recurrent layers (a state slot per sequence)

    @property
    def is_first(self) -> bool:
        return self.layers.start == 0

    def describe(self) -> str:
        return f"stage {self.index}: layers {self.layers.start}-{self.layers.stop - 1}"
