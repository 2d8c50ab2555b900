"""What attention needs to know about a batch: where each sequence's tokens are."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """A flat batch of S sequences and T new tokens over a paged KV cache.

    Sequence i computes query tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flat batch, which are the last ``query_len`` of its ``seq_lens[i]`` context tokens
    (earlier ones are already cached). A prefill chunk, a cached-prefix extend and a
    decode (query_len 1) are the same thing here, and one batch may mix them.

    slot_mapping     [T] int64   cache slot of each new token: block_id * block_size + offset
    query_start_loc  [S+1] int32 cumulative query lengths
    seq_lens         [S] int32   context length of each sequence including this step
    block_tables     [S, max_blocks] int32  the sequence's blocks in order; padding is -1
    max_query_len / max_seq_len / is_decode_only: host-side facts, so backends need no sync

    A captured step (engine/step_graphs.py) fixes the host-side facts at capture:
    ``max_query_len`` is then the step's padded token count, the lists are placeholders,
    and the split of sequences into decodes and prefills comes on the device instead:
    decode_seqs      [D] int32   sequences with query_len 1, then -1 (padding)
    prefill_seqs     [P] int32   sequences with query_len > 1, then -1
    Backends that declare ``step_graph_safe`` read them when they are set.

    new_rows_per_seq: the most rows one sequence's context gains this step. A speculative
    verify step may run as decode rows, one per token (the newest, then each draft), each
    row its own entry over the same block table with context up to that token: every
    row's K/V must then be stored before any row attends, so a backend that fuses the store
    into the attention kernel, or reads the newest row early, must not for such a batch.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    decode_seqs: torch.Tensor | None = None
    prefill_seqs: torch.Tensor | None = None
    new_rows_per_seq: int = 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
