"""CUDA graphs for decode steps: capture a step's launches once per shape, then replay them in one call.

A decode step of a small model is hundreds of short kernels; launching them one by one from Python costs
more than running them. A graph is captured from an ordinary `model.forward` with everything it touches at
fixed addresses:

    pinned inputs --HtoD (node 1)--> device inputs: token ids, positions, slots, token_seq, tables, rows
    kernels (captured launches) reading the weights, the KV pool and a private activation pool
    last activation --DtoH (last node)--> pinned output (the logits)

A replay writes the new step's index arrays into the pinned inputs, launches the graph and copies the
logits out of the pinned output. The key is everything that shapes a launch: rows, logit rows, the padded
block-table width (rounded up to a power of two so a growing context changes it rarely), the pool.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from engine.backends.cuda.arena import GrowingPool
from engine.backends.cuda.array import blocks_needed_by, pack_layout, step_arrays
from engine.backends.cuda.device import PinnedBuffer, check, driver
from engine.batch import BatchMeta
from engine.units import MIB

log = logging.getLogger("strata.cuda")
GRAPH_REGION_BYTES = 8 * MIB  # a graph's private activation pool grows in pieces of this size
MAX_GRAPH_TOKENS = 16  # decode batches up to this many rows are graphed
MAX_GRAPHS = 32  # least recently used graphs are destroyed beyond this
MIN_TABLE_BLOCKS = 4


def table_bucket(blocks: int) -> int:
    """Padded block-table width for a graph: the next power of two (at least MIN_TABLE_BLOCKS)."""
    width = MIN_TABLE_BLOCKS
    while width < blocks:
        width *= 2
    return width


class _Graph:
    """One instantiated graph with the buffers its nodes read and write."""

    def __init__(self, device, arrays: dict[str, np.ndarray], output_bytes: int):
        self.device = device
        self.offsets, self.input_bytes = pack_layout(arrays)
        self.inputs_host = PinnedBuffer(self.input_bytes)
        self.inputs_device = device.alloc(self.input_bytes, "graph inputs")
        self.pool = GrowingPool(device.reserve, GRAPH_REGION_BYTES, device.unreserve)
        self.output = PinnedBuffer(output_bytes)
        self.output_shape: tuple[int, ...] | None = None
        self.exec = None

    def addresses(self) -> dict[str, int]:
        return {name: self.inputs_device + offset for name, offset in self.offsets.items()}

    def write_inputs(self, arrays: dict[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            start = self.offsets[name]
            self.inputs_host.array[start : start + array.nbytes] = array.view(np.uint8)

    def capture_output(self, x, stream) -> np.ndarray:
        """Called by to_host during capture: the DtoH copy becomes the graph's last node."""
        assert x.nbytes <= self.output.nbytes, f"graph output {x.shape} larger than its buffer"
        self.device.dtoh(self.output.ptr, x.ptr, x.nbytes, stream)
        self.output_shape = x.shape
        return self.output.view(x.dtype, x.shape)

    def destroy(self) -> None:
        if self.exec is not None:
            driver.cuGraphExecDestroy(self.exec)
            self.exec = None
        self.pool.release_all()
        self.device.unreserve(self.inputs_device)
        self.inputs_host.close()
        self.output.close()


class DecodeGraphs:
    """Per-backend cache of decode-step graphs, keyed by shape (see the module docstring)."""

    def __init__(self, backend, max_tokens: int = MAX_GRAPH_TOKENS, max_graphs: int = MAX_GRAPHS):
        self.backend = backend
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.captures = self.replays = 0

    def eligible(self, batch: BatchMeta) -> bool:
        """Decode steps (one new token per sequence) of up to max_tokens rows, and not while profiling."""
        return (batch.num_tokens <= self.max_tokens and all(s.query_len == 1 for s in batch.seqs)
                and self.backend.kernels.profiler is None)

    def run(self, model, batch: BatchMeta, pool) -> np.ndarray:
        """Logits of the step, from the graph of its shape (captured now if there is none)."""
        width = table_bucket(blocks_needed_by(batch))
        arrays = step_arrays(batch, width)
        key = (batch.num_tokens, len(batch.logit_rows), width, batch.block_size, id(pool))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(model, batch, pool, arrays, width)
            self._graphs[key] = graph
        else:
            self._graphs.move_to_end(key)
        b = self.backend
        graph.write_inputs(arrays)  # the previous replay has finished: synchronised, or its event observed
        b.launch_graph(graph.exec)
        self.replays += 1
        if b.defers_host:  # the step runner awaits the stream's event, then copies the logits out
            return graph.output.view(np.float32, graph.output_shape)
        b.synchronize_stream(b.stream)
        return graph.output.view(np.float32, graph.output_shape).copy()

    def _capture(self, model, batch: BatchMeta, pool, arrays: dict[str, np.ndarray], width: int) -> _Graph:
        b = self.backend
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)[1].destroy()
        b.begin_step()  # nothing of an eager step may be read by the graph
        graph = _Graph(b.device, arrays, len(batch.logit_rows) * model.config.vocab_size * 4)
        b.register_step(batch, graph.addresses(), width)
        b.capture_into(graph)
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL  # other threads' calls stay legal
        check(driver.cuStreamBeginCapture(b.stream, mode), "cuStreamBeginCapture")
        try:
            b.device.htod(graph.inputs_device, graph.inputs_host.ptr, graph.input_bytes, b.stream)
            model.forward(batch, pool)
        except BaseException:
            _, partial = driver.cuStreamEndCapture(b.stream)  # leave the stream usable
            if partial is not None and int(partial):
                driver.cuGraphDestroy(partial)
            graph.destroy()
            raise
        finally:
            b.end_capture()
            b.forget_step()  # no synchronising here: the stream may still be capturing
        cuda_graph = check(driver.cuStreamEndCapture(b.stream), "cuStreamEndCapture")
        try:
            graph.exec = check(driver.cuGraphInstantiate(cuda_graph, 0), "cuGraphInstantiate")
        finally:
            driver.cuGraphDestroy(cuda_graph)
        self.captures += 1
        log.info("cuda graph captured: %d rows, table width %d (%d graphs)", batch.num_tokens, width,
                 len(self._graphs) + 1)
        return graph

    def clear(self) -> None:
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
