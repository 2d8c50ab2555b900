"""Inputs of an eager step (prefill, chunked prefill, prefills beside decodes): token ids,
positions, the attention metadata and the rows the step samples, built with numpy and sent
to the device in one copy.

A 16k-token step has 16k positions and cache slots to compute; per-token Python loops and
one ``torch.tensor`` per field would take ~7 ms of host time for one on a 2-core VM.
Worse, a ``torch.tensor(..., device="cuda")`` copies from pageable memory, which makes the
host wait for the GPU to drain: a step could not be prepared while the one before it runs.
Here the per-token work is array arithmetic, written straight into one pinned buffer, and
one non-blocking copy sends it.

Every field starts on a 16-byte boundary of that buffer. Triton specialises a kernel on
whether each pointer argument is 16-byte aligned, so fields at arbitrary offsets would
make the attention and RoPE kernels compile new variants in the middle of serving, with
every step behind them waiting. For the same reason the block table's width (its row
stride, a kernel argument) is a multiple of 16: Triton also specialises integer arguments
on divisibility by 16 (and on being 1), so a width following the batch's longest sequence
would flip between variants as contexts grow, and a server would compile one mid-request.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from atom_core.layers.attention.metadata import AttentionMetadata

ALIGN_BYTES = 16
TABLE_WIDTH_MULTIPLE = 16  # Triton's integer divisibility specialisation


@dataclass
class EagerInputs:
    input_ids: torch.Tensor | None  # [T] int64; None for a profiling run
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S'] int64: the flat rows whose logits are sampled
    fill_rows: torch.Tensor  # [F] int64: rows whose input id the previous step samples ...
    fill_from: torch.Tensor  # [F] int64: ... at these indices of its sampled ids


class _Packer:
    """Fields laid out in one int64 buffer, each at a 16-byte aligned offset."""

    def __init__(self) -> None:
        self.fields: list[np.ndarray] = []
        self.offsets: list[int] = []
        self.size = 0  # int64 elements

    def add(self, values: np.ndarray) -> int:
        self.fields.append(values)
        self.offsets.append(self.size)
        words = -(-values.nbytes // ALIGN_BYTES) * (ALIGN_BYTES // 8)
        self.size += max(words, ALIGN_BYTES // 8)
        return len(self.fields) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every field as a view of one device buffer, after one host-to-device copy."""
        pin = device.type == "cuda"
        # Pinned blocks come from torch's caching host allocator, which does not hand a
        # block out again before the copy reading it has run.
        host = torch.empty(self.size, dtype=torch.int64, pin_memory=pin)
        flat = host.numpy()
        for values, off in zip(self.fields, self.offsets):
            flat[off : off + -(-values.nbytes // 8)].view(values.dtype)[: values.size] = values
        dev = host.to(device, non_blocking=pin) if device.type != "cpu" else host
        views = []
        for values, off in zip(self.fields, self.offsets):
            dtype = torch.int32 if values.dtype == np.int32 else torch.int64
            views.append(dev[off : off + -(-values.nbytes // 8)].view(dtype)[: values.size])
        return views


def token_layout(
    starts: list[int], counts: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A flat step where sequence i computes ``counts[i]`` tokens from position
    ``starts[i]``: (query_start_loc [S+1], the sequence of each token [T], each token's
    position [T]), int64."""
    lens = np.asarray(counts, dtype=np.int64)
    qsl = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    owner = np.repeat(np.arange(len(counts)), lens)
    positions = np.arange(int(qsl[-1]), dtype=np.int64) + (
        np.asarray(starts, dtype=np.int64) - qsl[:-1])[owner]
    return qsl, owner, positions


def eager_inputs(
    token_rows: list[list[int]] | None,
    starts: list[int],
    counts: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sample: list[int] | None = None,
    fill: tuple[list[int], list[int]] | None = None,
    drafts: list[list[int]] | None = None,
) -> EagerInputs:
    """Sequence i computes tokens ``starts[i]`` to ``starts[i] + counts[i]`` of
    ``token_rows[i]``, over block table ``tables[i]`` (covering those tokens). ``sample``:
    the sequences whose last computed row is sampled. ``fill``: (sequences, indices): the
    input id of each such sequence's last computed row is taken on the device from the
    previous step's sampled ids at that index. ``token_rows`` None: no ids (a profiling run).
    ``drafts``: tokens sequence i computes after its own (speculative decoding), the last
    ``len(drafts[i])`` of its ``counts[i]``; they are not in ``token_rows[i]``."""
    n = len(counts)
    lens = np.asarray(counts, dtype=np.int64)
    qsl, owner, positions = token_layout(starts, counts)
    total = int(qsl[-1])
    seq_lens = np.asarray(starts, dtype=np.int64) + lens
    width = -(-max(len(t) for t in tables) // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
    table_rows = np.full((n, width), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        table_rows[i, : len(t)] = t
    blocks = table_rows[owner, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size

    pack = _Packer()
    ids_at = None
    if token_rows is not None:
        extra = drafts or [[]] * n
        rows = (chain(row[a : a + c - len(e)], e)
                for row, a, c, e in zip(token_rows, starts, counts, extra))
        ids_at = pack.add(np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total))
    pos_at = pack.add(positions)
    slots_at = pack.add(slots)
    qsl_at = pack.add(qsl.astype(np.int32))
    lens_at = pack.add(seq_lens.astype(np.int32))
    tables_at = pack.add(table_rows.reshape(-1))
    sample_at = pack.add(qsl[1:][np.asarray(sample or [], dtype=np.int64)] - 1)
    fill_seqs, fill_from = fill or ([], [])
    fill_rows_at = pack.add(qsl[1:][np.asarray(fill_seqs, dtype=np.int64)] - 1)
    fill_from_at = pack.add(np.asarray(fill_from, dtype=np.int64))
    dev = pack.send(device)
    meta = AttentionMetadata(
        slot_mapping=dev[slots_at],
        query_start_loc=dev[qsl_at],
        seq_lens=dev[lens_at],
        block_tables=dev[tables_at].view(n, width),
        block_size=block_size,
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return EagerInputs(
        None if ids_at is None else dev[ids_at], dev[pos_at], meta, dev[sample_at],
        dev[fill_rows_at], dev[fill_from_at],
    )
