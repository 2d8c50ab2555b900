"""Decode-step inputs in persistent buffers: host rows filled in place, two async copies.

A decode step needs, per sequence, its newest token, position, cache slot and context
length, plus its block table (a speculative verify step has a row like that for each
draft token too). They live in one pinned host buffer per dtype and a device
twin of each; a step writes its rows on the host and issues two non-blocking host-to-device
copies (a pageable copy would make the host wait for the GPU to drain). The device
buffers never move, so CUDA graphs captured over them replay any step's contents.

Block-table rows are rewritten only when a row's table changed (a decode appends a block
every ``block_size`` steps), so a steady batch of long contexts costs no per-step copy of
its tables on the host.
"""

from __future__ import annotations

import torch

from atom_core.engine.sequence import Sequence
from atom_core.layers.attention.metadata import AttentionMetadata

IDS, POSITIONS, SLOTS, SEQ_LENS = range(4)


class DecodeInputs:
    def __init__(
        self, max_seqs: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.zeros((4, max_seqs), dtype=torch.long, pin_memory=pin)
        self.host_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, pin_memory=pin)
        self._host = self.host.numpy()
        self._host_tables = self.host_tables.numpy()
        self.dev = torch.zeros((4, max_seqs), dtype=torch.long, device=device)
        self.dev_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self._rows: list[list[int] | None] = [None] * max_seqs  # table each host row holds
        # Recorded after each step's copies. With --async-scheduling the host fills step k+1's
        # rows while step k may still be queued behind k-1, so it checks that k's copies out
        # of these pinned buffers have run before overwriting them (in practice, long ago).
        self._copied = torch.cuda.Event() if pin else None
        self.pad_rows(0, max_seqs)
        self.dev.copy_(self.host)

    def pad_rows(self, start: int, stop: int) -> None:
        """Rows that compute nothing: slot -1 (no cache write), context 0 (no attention)."""
        h = self._host
        h[IDS, start:stop] = 0
        h[POSITIONS, start:stop] = 0
        h[SLOTS, start:stop] = -1
        h[SEQ_LENS, start:stop] = 0

    def prepare(self, seqs: list[Sequence], padded: int,
                drafts: list[list[int]] | None = None) -> list[int]:
        """Fill rows for ``seqs`` (each computing its one newest token) and pad up to
        ``padded`` rows; start the copies. Returns the context lengths (host).
        ``drafts``: draft tokens sequence i also computes (speculative verify), each a row
        of its own after the sequence's newest, over the same block table."""
        ids, positions, tables = [], [], []
        for i, s in enumerate(seqs):
            p = s.num_computed_tokens
            for tok in (s.token_ids[p],) if drafts is None else (s.token_ids[p], *drafts[i]):
                ids.append(tok)
                positions.append(p)
                tables.append(s.block_table)
                p += 1
        return self.prepare_rows(ids, positions, tables, padded)

    def prepare_rows(self, ids: list[int] | None, positions: list[int],
                     tables: list[list[int]], padded: int) -> list[int]:
        """Fill one row per position (its token, position, block table; ``ids`` None:
        zeros, for ids the caller copies in on the device) and pad up to ``padded`` rows;
        start the copies. Returns the context lengths (host)."""
        if self._copied is not None:
            self._copied.synchronize()
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for p, t in zip(positions, tables)]
        lens = [p + 1 for p in positions]
        held, h_tables = self._rows, self._host_tables
        for r, table in enumerate(tables):
            if held[r] != table:
                h_tables[r, : len(table)] = table
                held[r] = list(table)
        n = len(positions)
        h = self._host
        h[IDS, :n] = ids if ids is not None else 0
        h[POSITIONS, :n] = positions
        h[SLOTS, :n] = slots
        h[SEQ_LENS, :n] = lens
        self.pad_rows(n, padded)
        self.dev.copy_(self.host, non_blocking=True)
        self.dev_tables[:padded].copy_(self.host_tables[:padded], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return lens

    def load_rows(self, n: int, padded: int, ids: torch.Tensor, positions: torch.Tensor,
                  tables: torch.Tensor) -> None:
        """Fill the first ``n`` device rows from device tensors (ids, positions [n], block
        tables [n, max_blocks]) and pad up to ``padded``, without the host buffers: the
        host neither waits for their last copy nor knows the positions (a draft step after
        a verify step sits past the accepted drafts, which the host has not read)."""
        self.dev[IDS, :n] = ids
        self.dev[POSITIONS, :n] = positions
        self.dev[SEQ_LENS, :n] = positions + 1
        self.dev_tables[:n] = tables
        blocks = tables.gather(1, (positions // self.block_size)[:, None])
        self.dev[SLOTS, :n] = blocks[:, 0].long() * self.block_size + positions % self.block_size
        self.dev[:, n:padded] = 0
        self.dev[SLOTS, n:padded] = -1

    def input_ids(self, n: int) -> torch.Tensor:
        return self.dev[IDS, :n]

    def positions(self, n: int) -> torch.Tensor:
        return self.dev[POSITIONS, :n]

    def metadata(
        self, n: int, seq_lens_cpu: list[int] | None, max_model_len: int,
        new_rows_per_seq: int = 1,
    ) -> AttentionMetadata:
        """Metadata over the first ``n`` rows. ``seq_lens_cpu`` None means graph capture:
        the host-side facts are then placeholders no graph-safe backend reads.
        ``new_rows_per_seq``: the most rows one sequence has (``prepare``'s drafts)."""
        lens = seq_lens_cpu if seq_lens_cpu is not None else [max_model_len] * n
        return AttentionMetadata(
            slot_mapping=self.dev[SLOTS, :n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.dev[SEQ_LENS, :n],
            block_tables=self.dev_tables[:n],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=max(lens, default=0) if seq_lens_cpu is not None else max_model_len,
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=lens,
            new_rows_per_seq=new_rows_per_seq,
        )
