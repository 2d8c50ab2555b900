"""Decode from captured CUDA graphs: one graph per --cudagraph-capture-sizes row count.

Each graph runs a forward over ``n`` decode rows of ``DecodeInputs``' static buffers and
keeps its static outputs: for the target, the whole model plus ``compute_logits`` (and,
where a draft network reads them, its hidden input); for a draft network, its own
forward. A step of ``b`` rows replays the smallest captured size >= b; the rows past
``b`` are padding (slot -1, context 0) whose results are ignored. Graphs share one
memory pool and are captured largest first, so the smaller ones reuse the larger one's
memory.

With speculative decoding a verify step's drafts are decode rows too (``DecodeInputs.
prepare``'s drafts): ``AttentionMetadata.new_rows_per_seq`` tells the attention how many
rows one sequence may have, fixed at capture.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from atom_core.engine.capture_traces import CaptureTracer
from atom_core.engine.input_batch import DecodeInputs
from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import forward_context

logger = logging.getLogger(__name__)

# A forward over the first n rows of the inputs, given their metadata: its outputs.
RowForward = Callable[[int, AttentionMetadata], tuple[torch.Tensor | None, ...]]


def capture_graph(
    forward: Callable[[], Any], pool: object | None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``forward`` run once eagerly (Triton compiles and autotunes, backends cache their
    plans, all outside the capture), then captured into a graph sharing ``pool``; the graph
    and its static output."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    torch.cuda.synchronize()
    return graph, out


class CudaGraphRunner:
    def __init__(
        self, forward: RowForward, inputs: DecodeInputs, capture_sizes: list[int],
        max_model_len: int, tracer: CaptureTracer | None = None, new_rows_per_seq: int = 1,
        name: str = "decode",
    ) -> None:
        self.forward = forward
        self.tracer = tracer or CaptureTracer(None)
        self.inputs = inputs
        self.max_model_len = max_model_len
        self.new_rows_per_seq = new_rows_per_seq
        self.name = name
        self.sizes = sorted({s for s in capture_sizes if 0 < s <= inputs.max_seqs})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.pool: object | None = None  # the graphs' memory pool, for others to share

    def padded_size(self, n: int) -> int | None:
        """The captured size that serves ``n`` rows, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, n: int) -> tuple[torch.Tensor | None, ...]:
        meta = self.inputs.metadata(n, None, self.max_model_len, self.new_rows_per_seq)
        with forward_context(meta):
            return self.forward(n, meta)

    @torch.inference_mode()
    def capture(self, pool: object | None = None) -> None:
        start = time.perf_counter()
        # Every row is padding while capturing: the kernels run but touch no cache slot.
        self.inputs.pad_rows(0, self.inputs.max_seqs)
        self.inputs.dev.copy_(self.inputs.host)
        for n in reversed(self.sizes):
            with self.tracer.trace(n):
                graph, self.outputs[n] = capture_graph(lambda n=n: self._forward(n), pool)
            pool = graph.pool()
            self.graphs[n] = graph
        self.pool = pool
        torch.cuda.synchronize()
        logger.info(
            "captured %d %s CUDA graphs (row counts %s) in %.1f s",
            len(self.graphs), self.name, self.sizes, time.perf_counter() - start,
        )

    def replay(self, padded: int) -> tuple[torch.Tensor | None, ...]:
        """Run the graph of size ``padded`` over the inputs already copied; its outputs."""
        self.graphs[padded].replay()
        return self.outputs[padded]
