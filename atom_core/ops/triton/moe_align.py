"""Token -> expert alignment for the grouped-GEMM MoE kernels, on device and sync-free.

The T*k (token, slot) pairs are sorted by expert and each expert's segment is padded to a
multiple of ``block_m``, so every block of ``block_m`` sorted rows belongs to one expert
and a kernel program can run one expert's GEMM over it. Everything is torch ops on the
tensors' device with sizes fixed by (T, k, E, block_m) alone - no ``.item()``, no boolean
indexing, no ``bincount`` (its CUDA kernel reads the max on the host) - so the whole
thing can be captured in a CUDA graph and replayed with other ids.
"""

from __future__ import annotations

import torch


def aligned_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows in the padded, sorted layout: at most min(pairs, E) experts are non-empty and
    each wastes at most block_m - 1 padding rows."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)``.

    ``sorted_pairs`` [capacity] int32: the flat pair index ``t * k + j`` held by each
    padded row, or ``T * k`` on a padding row. ``block_expert`` [capacity / block_m] int32:
    the expert of each block of rows, or -1 for the blocks past the last expert's segment.
    Pairs whose id is outside ``[0, E)`` get no row at all.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs, device = flat.numel(), flat.device
    # Out-of-range ids go to a sentinel expert E that sorts last and is never laid out.
    eid = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, eid, torch.ones_like(eid))
    order = torch.argsort(eid, stable=True)  # stable: each expert's rows stay in token order
    sorted_eid = eid[order]
    starts = torch.cumsum(counts, 0) - counts
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # in place: a scalar assignment copies from the host (not capturable)
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    capacity = aligned_capacity(num_pairs, num_experts, block_m)
    rank = torch.arange(num_pairs, device=device) - starts[sorted_eid]
    # The sentinel expert's pairs land in one spare slot past the end, then cut off.
    dest = torch.where(sorted_eid < num_experts, padded_starts[sorted_eid] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends[:num_experts], block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:capacity], block_expert
