"""Decode from captured CUDA graphs: one graph per --cudagraph-capture-sizes batch size.

Each graph runs the whole model plus ``compute_logits`` for ``bs`` decode rows, reading the
static buffers of ``DecodeInputs`` and writing a static logits tensor. A step of ``b``
sequences replays the smallest captured size >= b; the rows past ``b`` are padding (slot
-1, context 0) whose results are ignored. Graphs share one memory pool and are captured
largest first, so the smaller ones reuse the larger one's memory.

With speculative decoding a verify step's drafts are decode rows too (``DecodeInputs.
prepare``'s drafts; ``AttentionMetadata.new_rows_per_seq`` says how many rows a sequence
may have), and a draft network that reads the target's hidden states gets them from a
second static output (``hidden_out``, e.g. EAGLE-3's projection of three layers).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from atom_core.engine.capture_traces import CaptureTracer
from atom_core.engine.input_batch import DecodeInputs
from atom_core.layers.context import forward_context

logger = logging.getLogger(__name__)


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
        self, model: nn.Module, inputs: DecodeInputs, capture_sizes: list[int], max_model_len: int,
        tracer: CaptureTracer | None = None, new_rows_per_seq: int = 1,
        hidden_out: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.new_rows_per_seq = new_rows_per_seq
        self.hidden_out = hidden_out
        self.hidden: dict[int, torch.Tensor] = {}  # hidden_out's static outputs
        self.tracer = tracer or CaptureTracer(None)
        self.inputs = inputs
        self.max_model_len = max_model_len
        self.sizes = sorted({s for s in capture_sizes if 0 < s <= inputs.max_seqs})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: object | None = None  # the graphs' memory pool, for others to share

    def padded_size(self, n: int) -> int | None:
        """The captured size that serves ``n`` sequences, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta = self.inputs.metadata(n, None, self.max_model_len, self.new_rows_per_seq)
        with forward_context(meta):
            hidden = self.model(self.inputs.input_ids(n), self.inputs.positions(n))
            logits = self.model.compute_logits(hidden)
            return logits, self.hidden_out(hidden) if self.hidden_out is not None else None

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # Every row is padding while capturing: the kernels run but touch no cache slot.
        self.inputs.pad_rows(0, self.inputs.max_seqs)
        self.inputs.dev.copy_(self.inputs.host)
        pool = None
        for n in reversed(self.sizes):
            with self.tracer.trace(n):
                graph, (self.logits[n], hidden) = capture_graph(lambda n=n: self._forward(n),
                                                                pool)
            if hidden is not None:
                self.hidden[n] = hidden
            pool = graph.pool()
            self.graphs[n] = graph
        self.pool = pool
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %s) in %.1f s",
            len(self.graphs), self.sizes, time.perf_counter() - start,
        )

    def replay(self, padded: int) -> torch.Tensor:
        """Run the graph of size ``padded`` over the inputs already copied; its logits."""
        self.graphs[padded].replay()
        return self.logits[padded]
