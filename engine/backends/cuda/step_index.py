"""A step's index arrays on the device: one packed upload per step, found by the ops through a registry.

A mixin of CudaBackend (cuda/backend.py). Its state is created by CudaBackend.__init__: `_step` (registry key
-> device address for the current step, keys from array.registry_keys: (id(numpy array), dtype name))
and `_step_keep` (what keeps those ids and device copies alive until the step is forgotten).

    batch arrays --step_arrays + pack_layout--> [ids | positions | slots | token_seq | tables | logit rows]
                 --one upload_activation--> device copy;  _step[(id(batch.positions), "int32")] = its address
"""
from __future__ import annotations

import numpy as np

from engine.backends.cuda.array import blocks_needed_by, pack_layout, registry_keys, step_arrays
from engine.batch import BatchMeta


class CudaStepIndex:
    """begin_step / register_step / forget_step, and the lookups the ops use (`_index`, `_seq_info`, and
    `step_table` for an op module's own per-step table, e.g. conv_state)."""

    def run_forward(self, model, batch: BatchMeta, pool) -> np.ndarray:
        """model.forward(batch, pool), replayed from a CUDA graph when the step's shape has one."""
        if self.graphs is not None and self.graphs.eligible(batch):
            return self.graphs.run(model, batch, pool)
        self.begin_step(batch)
        return model.forward(batch, pool)

    def begin_step(self, batch: BatchMeta | None = None) -> None:
        """Forget the previous step's index arrays; with a batch, upload all of this step's in one copy.

        Model.forward starts one implicitly (its embedding op); a pipeline stage that starts at a later layer
        calls this before its first op.
        """
        self._recycle_staging(0)
        self.forget_step()
        if self.expert_cache is not None:
            self.expert_cache.at_step_start()  # a resize the budget asked for happens between steps only
        if batch is not None:
            max_blocks = blocks_needed_by(batch)
            arrays = step_arrays(batch, max_blocks)
            offsets, total = pack_layout(arrays)
            packed = np.zeros(total, dtype=np.uint8)
            for name, array in arrays.items():
                packed[offsets[name] : offsets[name] + array.nbytes] = array.view(np.uint8)
            device_copy = self.upload_activation(packed)
            self.register_step(batch, {n: device_copy.ptr + offsets[n] for n in arrays}, max_blocks,
                               keep=[device_copy])

    def forget_step(self) -> None:
        """Drop the current step's registered index arrays (their device copies return to the workspace)."""
        self._step.clear()
        self._step_keep.clear()

    def register_step(self, batch: BatchMeta, addresses: dict[str, int], max_blocks: int, keep=()) -> None:
        """Make the ops of this step find the batch's index arrays at `addresses` (see array)."""
        for name, key in registry_keys(batch).items():
            self._step[key] = addresses[name]
        self._step[(id(batch), "max_blocks")] = max_blocks
        self._step_keep += [batch, *keep]

    def step_table(self, batch: BatchMeta, name: str, build) -> int:
        """Device address of a per-step table of the batch registered under `name`: `build()` (a host array)
        uploaded at the step's first call, the same address for the rest of the step (e.g. every layer)."""
        key = (id(batch), name)
        if key not in self._step:
            copy = self.upload_activation(build())
            self._step[key] = copy.ptr
            self._step_keep += [batch, copy]
        return self._step[key]

    def _index(self, values: np.ndarray, dtype) -> int:
        """Device address of a step's index array as dtype: the registered copy, else uploaded now."""
        key = (id(values), np.dtype(dtype).name)
        if key not in self._step:
            copy = self.upload_activation(np.asarray(values, dtype=dtype))
            self._step[key] = copy.ptr
            self._step_keep += [values, copy]
        return self._step[key]

    def _seq_info(self, batch: BatchMeta) -> tuple[int, int, int]:
        """(token_seq, block_tables, max_blocks) of the batch on the device."""
        if (id(batch), "max_blocks") not in self._step:
            max_blocks = blocks_needed_by(batch)
            arrays = step_arrays(batch, max_blocks)
            token_seq, tables = (self.upload_activation(arrays[n]) for n in ("token_seq", "block_tables"))
            self._step[(id(batch), "token_seq")] = token_seq.ptr
            self._step[(id(batch), "block_tables")] = tables.ptr
            self._step[(id(batch), "max_blocks")] = max_blocks
            self._step_keep += [batch, token_seq, tables]
        return (self._step[(id(batch), "token_seq")], self._step[(id(batch), "block_tables")],
                self._step[(id(batch), "max_blocks")])
