"""Prefill from captured CUDA graphs: one graph per padded token count, for a step that
computes one sequence's tokens and nothing else (a lone prompt, a chunk of one, a
recompute after preemption).

An eager step of Qwen3-8B queues about 500 kernels through Python (module calls, Triton's
launcher, cuBLAS): ~24 ms of host time on the H200 machine's host for the ~11 ms of GPU
work of a 512-token prompt (bench/prefill_host.py), so a lone prompt's time to first
token was the host's. A graph queues the same kernels in one launch.

A step of ``n`` tokens replays the smallest captured size ``T >= n``. Rows ``n..T`` are
padding: token 0 at position 0 with cache slot -1 (no cache write), past the sequence's
query range (``query_start_loc`` = [0, n] on the device), so attention never reads them,
and the LM head reads only row ``n - 1`` (a static index). The host-side facts of the
metadata are fixed at capture (one sequence, ``max_query_len`` = T): only backends that
declare ``prefill_graph_safe`` (they read the rest from the device tensors) get graphs.
Graphs share the decode graphs' memory pool and are captured largest first.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from atom_core.engine.cuda_graphs import capture_graph
from atom_core.engine.sequence import Sequence
from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import forward_context

logger = logging.getLogger(__name__)

IDS, POSITIONS, SLOTS = range(3)
QSL_END, SEQ_LEN, LAST_ROW, TABLE = 1, 2, 3, 4  # int32 fields (QSL start is always 0)


class PrefillGraphs:
    """Static inputs for one-sequence steps and, once ``capture`` has run, their CUDA
    graphs. Without graphs (the CPU, tests) the same padded inputs run the model eagerly."""

    def __init__(
        self, model: nn.Module, sizes: list[int], max_blocks: int, block_size: int,
        max_model_len: int, device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = sorted(set(sizes))
        self.block_size = block_size
        self.max_model_len = max_model_len
        top = self.sizes[-1]
        pin = device.type == "cuda"
        self.host = torch.zeros((3, top), dtype=torch.long, pin_memory=pin)
        self.host_small = torch.zeros(TABLE + max_blocks, dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros((3, top), dtype=torch.long, device=device)
        self.dev_small = torch.zeros(TABLE + max_blocks, dtype=torch.int32, device=device)
        self._host, self._small = self.host.numpy(), self.host_small.numpy()
        self._copied = torch.cuda.Event() if pin else None  # the pinned rows are free again
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._metas: dict[int, AttentionMetadata] = {}  # kept: backends cache plans on them

    def padded_size(self, n: int) -> int | None:
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def _meta(self, size: int, n: int, seq_len: int) -> AttentionMetadata:
        d = self.dev_small
        return AttentionMetadata(
            slot_mapping=self.dev[SLOTS, :size],
            query_start_loc=d[:2],
            seq_lens=d[SEQ_LEN : SEQ_LEN + 1],
            block_tables=d[TABLE:].view(1, -1),
            block_size=self.block_size,
            max_query_len=n,
            max_seq_len=seq_len,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[seq_len],
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        with forward_context(meta):
            hidden = self.model(self.dev[IDS, :size], self.dev[POSITIONS, :size])
            last = self.dev_small[LAST_ROW : LAST_ROW + 1]
            return self.model.compute_logits(hidden.index_select(0, last))

    def _fill(self, ids: np.ndarray, start: int, n: int, table: list[int], size: int,
              write: bool = True) -> None:
        """Host rows of a step computing tokens ``start..start+n`` (ids given), padded to
        ``size``; then the two copies. ``write`` False: no row writes the cache."""
        if self._copied is not None:
            self._copied.synchronize()
        h, s, bs = self._host, self._small, self.block_size
        positions = np.arange(start, start + n, dtype=np.int64)
        h[IDS, :n] = ids
        h[POSITIONS, :n] = positions
        h[SLOTS, :n] = (np.asarray(table, dtype=np.int64)[positions // bs] * bs + positions % bs
                        if write else -1)
        h[IDS, n:size] = 0
        h[POSITIONS, n:size] = 0
        h[SLOTS, n:size] = -1
        s[QSL_END], s[SEQ_LEN], s[LAST_ROW] = n, start + n, n - 1
        s[TABLE : TABLE + len(table)] = table
        self.dev[:, :size].copy_(self.host[:, :size], non_blocking=True)
        width = TABLE + len(table)
        self.dev_small[:width].copy_(self.host_small[:width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    @torch.inference_mode()
    def capture(self, pool: object | None = None) -> None:
        """One graph per size, largest first (the smaller reuse its memory)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            # Every row reads block 0 (harmless values) and writes nothing (slot -1).
            self._fill(np.zeros(size, dtype=np.int64), 0, size, [0] * -(-size // self.block_size),
                       size, write=False)
            meta = self._meta(size, size, self.max_model_len)
            self._metas[size] = meta
            graph, self.logits[size] = capture_graph(
                lambda size=size, meta=meta: self._forward(size, meta), pool
            )
            pool = graph.pool()
            self.graphs[size] = graph
        logger.info("captured %d prefill CUDA graphs (one sequence, %d to %d tokens) in %.1f s",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def run(self, seq: Sequence, n: int) -> torch.Tensor:
        """Logits [1, vocab] of the last of the ``n`` tokens ``seq`` computes from its
        ``num_computed_tokens`` on, its block table already covering them."""
        size = self.padded_size(n)
        assert size is not None and n >= 2
        start = seq.num_computed_tokens
        ids = np.fromiter(seq.token_ids[start : start + n], dtype=np.int64, count=n)
        self._fill(ids, start, n, seq.block_table, size)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.logits[size]
        return self._forward(size, self._meta(size, n, start + n))
