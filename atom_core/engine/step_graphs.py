"""Steps that compute prompt tokens, from captured CUDA graphs: one graph per padded token
count, replayed for any batch of prompts, prompt chunks and decodes that fits it.

An eager step of Qwen3-8B queues about 500 kernels through Python (module calls, Triton's
launcher, cuBLAS): ~24 ms of host time on the H200 machine's host for the ~11 ms of GPU
work of a 512-token prompt (bench/prefill_host.py). A lone prompt's time to first token
was the host's, and under load the steps that mix a few hundred prompt tokens into the
running decodes (--mixed-prefill-tokens) were host bound too. A graph queues the same
kernels in one launch.

A step of ``n`` tokens over ``S`` sequences replays the smallest captured size ``T >= n``.
Its inputs live in static buffers the graph was captured over:
- per token, T rows: ids, positions, cache slots. Rows ``n..T`` are padding: token 0 at
  position 0, slot -1 (no cache write), in no sequence's query range.
- per sequence, ``C = min(T, max_seqs)`` rows: query_start_loc, seq_lens, block tables.
  Rows ``S..C`` are empty sequences (no query, no context).
- ``decode_seqs`` [C] and ``prefill_seqs`` [MAX_PROMPTS]: which sequences are which,
  padded with -1 (``AttentionMetadata``).
The graph ends at the final hidden states; the rows that sample go through the LM head
eagerly (one small GEMM). The host-side facts of the metadata are fixed at capture
(``max_query_len`` = T, the prefill grid's bound), so only backends that declare
``step_graph_safe`` get graphs. Graphs share the decode graphs' memory pool and are
captured largest first.

A graph sizes its decode attention for C decodes: a backend that splits a long context
over programs when it has few decodes (Triton's) would run a few long decodes under-split.
Steps whose decodes hold more than LONG_DECODE_CONTEXT tokens therefore run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from itertools import chain

import numpy as np
import torch
from torch import nn

from atom_core.engine.cuda_graphs import capture_graph
from atom_core.engine.sequence import Sequence
from atom_core.engine.step_inputs import token_layout
from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import forward_context
from atom_core.layers.transfer import host_to_device

logger = logging.getLogger(__name__)

IDS, POSITIONS, SLOTS = range(3)
MAX_PROMPTS = 8  # sequences computing 2+ tokens in one captured step; more run eagerly
LONG_DECODE_CONTEXT = 2048


def _aligned(n: int) -> int:
    """int32 elements rounded up to 16 bytes: every field starts aligned (Triton
    specialises kernels on their pointers' alignment)."""
    return -(-n // 4) * 4


class StepGraphs:
    """Static inputs for steps with prompt tokens and, once ``capture`` has run, their
    CUDA graphs. Without graphs (the CPU, tests) the same padded inputs run eagerly."""

    def __init__(
        self, model: nn.Module, sizes: list[int], max_seqs: int, max_blocks: int,
        block_size: int, max_model_len: int, device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = sorted(set(sizes))
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        top = self.sizes[-1]
        self.max_seqs = cap = min(max_seqs, top)
        # int32 per-sequence fields, in one buffer: query_start_loc, seq_lens, decode and
        # prefill indices, the rows that sample.
        self._qsl = 0
        self._lens = self._qsl + _aligned(cap + 1)
        self._dec = self._lens + _aligned(cap)
        self._pre = self._dec + _aligned(cap)
        self._sample = self._pre + _aligned(MAX_PROMPTS)
        width = self._sample + _aligned(cap)
        pin = device.type == "cuda"
        self.host_tok = torch.zeros((3, top), dtype=torch.long, pin_memory=pin)
        self.host_seq = torch.zeros(width, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros((cap, max_blocks), dtype=torch.int32, pin_memory=pin)
        self.dev_tok = torch.zeros((3, top), dtype=torch.long, device=device)
        self.dev_seq = torch.zeros(width, dtype=torch.int32, device=device)
        self.dev_tables = torch.zeros((cap, max_blocks), dtype=torch.int32, device=device)
        self._tok, self._seq = self.host_tok.numpy(), self.host_seq.numpy()
        self._tables = self.host_tables.numpy()
        self._rows: list[list[int] | None] = [None] * cap  # the table each host row holds
        self._copied = torch.cuda.Event() if pin else None  # the pinned rows are free again
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self._metas: dict[int, AttentionMetadata] = {}  # kept: backends cache plans on them

    def padded_size(self, n: int) -> int | None:
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, seqs: list[Sequence], counts: list[int]) -> bool:
        """A captured size holds the step: at least one and at most MAX_PROMPTS sequences
        computing 2+ tokens, at most ``max_seqs`` sequences, no long decode."""
        if len(seqs) > self.max_seqs or self.padded_size(sum(counts)) is None:
            return False
        prompts = 0
        for s, n in zip(seqs, counts):
            if n > 1:
                prompts += 1
            elif s.num_computed_tokens >= LONG_DECODE_CONTEXT:
                return False
        return 0 < prompts <= MAX_PROMPTS

    def _dev_field(self, start: int, n: int) -> torch.Tensor:
        return self.dev_seq[start : start + n]

    def _meta(self, size: int, qsl: np.ndarray | None = None,
              lens: np.ndarray | None = None) -> AttentionMetadata:
        """The metadata of a step padded to ``size`` tokens: capacity for
        ``min(size, max_seqs)`` sequences and MAX_PROMPTS prompts, ``max_query_len`` =
        ``size``. A graph is captured with placeholder host-side facts; an eager run (no
        graphs) gets the step's own (``qsl``, ``lens``) for backends that read them, and
        otherwise computes exactly what the graph would."""
        cap = min(size, self.max_seqs)
        return AttentionMetadata(
            slot_mapping=self.dev_tok[SLOTS, :size],
            query_start_loc=self._dev_field(self._qsl, cap + 1),
            seq_lens=self._dev_field(self._lens, cap),
            block_tables=self.dev_tables[:cap],
            block_size=self.block_size,
            max_query_len=size,
            max_seq_len=self.max_model_len if lens is None else int(lens.max()),
            query_start_loc_cpu=[0] * (cap + 1) if qsl is None else qsl.tolist(),
            seq_lens_cpu=[self.max_model_len] * cap if lens is None else lens.tolist(),
            decode_seqs=self._dev_field(self._dec, cap),
            prefill_seqs=self._dev_field(self._pre, MAX_PROMPTS),
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        with forward_context(meta):
            return self.model(self.dev_tok[IDS, :size], self.dev_tok[POSITIONS, :size])

    def _fill(self, seqs: list[Sequence], counts: list[int], sample: list[int],
              size: int) -> tuple[np.ndarray, np.ndarray]:
        """Host rows of the step, padded to ``size``; then the copies. Returns
        (query_start_loc, seq_lens)."""
        if self._copied is not None:
            self._copied.synchronize()
        starts = [s.num_computed_tokens for s in seqs]
        qsl, owner, positions = token_layout(starts, counts)
        n, num = int(qsl[-1]), len(seqs)
        tables, rows = self._tables, self._rows
        for i, s in enumerate(seqs):
            if rows[i] != s.block_table:
                tables[i, : len(s.block_table)] = s.block_table
                rows[i] = list(s.block_table)
        bs = self.block_size
        tok = self._tok
        ids = (s.token_ids[a : a + c] for s, a, c in zip(seqs, starts, counts))
        tok[IDS, :n] = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=n)
        tok[POSITIONS, :n] = positions
        tok[SLOTS, :n] = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        tok[:, n:size] = 0
        tok[SLOTS, n:size] = -1
        lens = np.asarray(starts, dtype=np.int64) + np.asarray(counts, dtype=np.int64)
        self._write_seq_fields(qsl, lens, np.asarray(counts), sample)
        self.dev_tok[:, :size].copy_(self.host_tok[:, :size], non_blocking=True)
        self.dev_seq.copy_(self.host_seq, non_blocking=True)
        self.dev_tables[:num].copy_(self.host_tables[:num], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return qsl, lens

    def _write_seq_fields(self, qsl: np.ndarray, lens: np.ndarray, counts: np.ndarray,
                          sample: list[int]) -> None:
        f, num, cap = self._seq, len(lens), self.max_seqs
        f[self._qsl : self._qsl + num + 1] = qsl
        f[self._qsl + num + 1 : self._qsl + cap + 1] = qsl[-1]  # empty sequences
        f[self._lens : self._lens + num] = lens
        f[self._lens + num : self._lens + cap] = 0
        for at, width, which in ((self._dec, cap, counts == 1),
                                 (self._pre, MAX_PROMPTS, counts > 1)):
            idx = np.flatnonzero(which)
            f[at : at + len(idx)] = idx
            f[at + len(idx) : at + width] = -1
        f[self._sample : self._sample + len(sample)] = qsl[1:][sample] - 1

    @torch.inference_mode()
    def capture(self, pool: object | None = None) -> None:
        """One graph per size, largest first (the smaller reuse its memory). Every row is
        padding while capturing: the kernels run but touch no cache slot."""
        start = time.perf_counter()
        self._tok[:] = 0
        self._tok[SLOTS] = -1
        self._write_seq_fields(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                               np.zeros(0, dtype=np.int64), [])
        self.dev_tok.copy_(self.host_tok)
        self.dev_seq.copy_(self.host_seq)
        for size in reversed(self.sizes):
            meta = self._meta(size)
            self._metas[size] = meta
            graph, self.hidden[size] = capture_graph(
                lambda size=size, meta=meta: self._forward(size, meta), pool
            )
            pool = graph.pool()
            self.graphs[size] = graph
        logger.info("captured %d step CUDA graphs (%d to %d tokens, up to %d prompts and %d "
                    "sequences) in %.1f s", len(self.graphs), self.sizes[0], self.sizes[-1],
                    MAX_PROMPTS, self.max_seqs, time.perf_counter() - start)

    def run(
        self, seqs: list[Sequence], counts: list[int], sample: list[int],
        fill: tuple[list[int], list[int]], fill_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """The final hidden states [len(sample), hidden] of the sampled sequences' last
        rows. Sequence i computes ``counts[i]`` tokens from its ``num_computed_tokens`` on,
        its block table already covering them. ``fill``: (sequences, indices): each such
        sequence's last row takes its input id from ``fill_ids`` at that index."""
        size = self.padded_size(sum(counts))
        assert size is not None
        qsl, lens = self._fill(seqs, counts, sample, size)
        if fill[0]:
            rows, src = host_to_device([(qsl[1:][fill[0]] - 1).tolist(), fill[1]], torch.long,
                                       self.device)
            self.dev_tok[IDS].index_copy_(0, rows, fill_ids.index_select(0, src))
        if size in self.graphs:
            self.graphs[size].replay()
            hidden = self.hidden[size]
        else:
            hidden = self._forward(size, self._meta(size, qsl, lens))
        return hidden.index_select(0, self._dev_field(self._sample, len(sample)))
