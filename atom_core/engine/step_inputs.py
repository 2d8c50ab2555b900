"""Inputs of an eager step (prefill, chunked prefill, prefills beside decodes): token ids,
positions and the attention metadata, built with numpy and sent in two copies.

A 16k-token step has 16k positions and cache slots to compute; per-token Python loops and
one ``torch.tensor`` per field took ~7 ms of host time for one on the 2-core VM, while the
GPU, its previous step read back, waits. Here the per-token work is array arithmetic and
the fields travel packed, int64 and int32, from pinned memory: a pageable copy would also
make the host wait for the GPU to drain before it starts.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from atom_core.layers.attention.metadata import AttentionMetadata


def _to_device(packed: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(packed)
    if device.type != "cuda":
        return host.to(device)
    # The pinned staging block comes from torch's caching host allocator, which keeps it
    # until the copy has run.
    return host.pin_memory().to(device, non_blocking=True)


def eager_inputs(
    token_rows: list[list[int]] | None,
    starts: list[int],
    counts: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata) for sequences i computing tokens ``starts[i]`` to
    ``starts[i] + counts[i]`` of ``token_rows[i]``, over block tables ``tables[i]`` (each
    covering its sequence's tokens). ``token_rows`` None: no ids (a profiling run)."""
    n = len(counts)
    lens = np.asarray(counts, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64)
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    total = int(qsl[-1])
    owner = np.repeat(np.arange(n), lens)  # the sequence of each flat token
    positions = np.arange(total, dtype=np.int64) + (first - qsl[:-1])[owner]
    seq_lens = first + lens
    width = max(len(t) for t in tables)
    small = np.full(n * width + 2 * n + 1, -1, dtype=np.int32)  # tables | qsl | seq_lens
    table_rows = small[: n * width].reshape(n, width)
    for i, t in enumerate(tables):
        table_rows[i, : len(t)] = t
    small[n * width : n * width + n + 1] = qsl
    small[n * width + n + 1 :] = seq_lens
    slots = table_rows[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    fields = [positions, slots]
    if token_rows is not None:
        rows = (row[a : a + c] for row, a, c in zip(token_rows, starts, counts))
        fields.insert(0, np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total))
    big = _to_device(np.concatenate(fields), device).view(len(fields), total)
    small_dev = _to_device(small, device)
    meta = AttentionMetadata(
        slot_mapping=big[-1],
        query_start_loc=small_dev[n * width : n * width + n + 1],
        seq_lens=small_dev[n * width + n + 1 :],
        block_tables=small_dev[: n * width].view(n, width),
        block_size=block_size,
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return (big[0] if token_rows is not None else None), big[-2], meta
