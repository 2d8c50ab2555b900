"""Token -> expert alignment for the grouped-GEMM MoE kernels, on device and sync-free.

The T*k (token, slot) pairs are sorted by expert and each expert's segment is padded to a
multiple of ``block_m``, so every block of ``block_m`` sorted rows belongs to one expert
and a kernel program can run one expert's GEMM over it. Everything is torch ops on the
tensors' device with sizes fixed by (T, k, E, block_m) alone - no ``.item()``, no boolean
indexing, no ``bincount`` (its CUDA kernel reads the max on the host) - so the whole
thing can be captured in a CUDA graph and replayed with other ids. Decode-sized batches
(at most SMALL_PAIRS pairs) take one Triton program instead, with the same layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.ops.native.moe import with_shared_expert_ids
from atom_kernels_triton.pdl import pdl_options, pdl_wait


def aligned_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows in the padded, sorted layout: at most min(pairs, E) experts are non-empty and
    each wastes at most block_m - 1 padding rows."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit
def pair_expert(ids_ptr, pair, valid, top_k, routed_k, first_shared):
    """The expert of each flat pair ``t * top_k + j`` (-1 where not ``valid``): routed slots
    (j < routed_k) read ``ids [T, routed_k]``; the others are shared experts, first_shared
    on, which no tensor holds."""
    t = pair // top_k
    j = pair - t * top_k
    routed = j < routed_k
    e = tl.load(ids_ptr + t * routed_k + j, mask=valid & routed, other=-1)
    return tl.where(routed | ~valid, e, first_shared + j - routed_k)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, num_shared: int = 0,
    block_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)``.

    ``sorted_pairs`` [capacity] int32: the flat pair index ``t * k + j`` held by each
    padded row, or ``T * k`` on a padding row; k counts the routed slots of ``topk_ids``,
    then ``num_shared`` slots, one for each shared expert (the last of the E).
    ``block_expert`` [capacity / block_m] int32: the expert of each block of rows, or -1 for
    the blocks past the last expert's segment. Pairs whose id is outside ``[0, E)`` get no
    row at all. ``block_counts`` (int32, [capacity / block_m]), if given, is zeroed on the way
    (a counter a block for the kernels that follow; no launch of its own at decode sizes).
    """
    num_tokens, routed_k = topk_ids.shape
    num_pairs = num_tokens * (routed_k + num_shared)
    capacity = aligned_capacity(num_pairs, num_experts, block_m)
    if 0 < num_pairs <= SMALL_PAIRS and num_experts <= SMALL_EXPERTS:
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        return _align_small(
            ids, num_pairs, routed_k + num_shared, num_experts, num_shared, block_m, capacity,
            block_counts
        )
    if block_counts is not None:
        block_counts.zero_()
    if num_shared:  # prefill sizes: the torch path takes the slots as ids
        topk_ids = with_shared_expert_ids(topk_ids, num_experts, num_shared)
    return _align_torch(topk_ids.reshape(-1).long(), num_experts, block_m, capacity)


def _align_torch(
    flat: torch.Tensor, num_experts: int, block_m: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    num_pairs, device = flat.numel(), flat.device
    # Out-of-range ids go to a sentinel expert E that sorts last and is never laid out.
    eid = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, eid, torch.ones_like(eid))
    order = torch.argsort(eid, stable=True)  # stable: each expert's rows stay in token order
    sorted_eid = eid[order]
    starts = torch.cumsum(counts, 0) - counts
    padded = (counts + block_m - 1) // block_m * block_m
    # In place: a scalar assignment copies from the host (not capturable).
    padded[num_experts:].zero_()
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    rank = torch.arange(num_pairs, device=device) - starts[sorted_eid]
    # The sentinel expert's pairs land in one spare slot past the end, then cut off.
    dest = torch.where(sorted_eid < num_experts, padded_starts[sorted_eid] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends[:num_experts], block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:capacity], block_expert


# Decode-sized batches (<= SMALL_PAIRS pairs) are laid out by one launch of E + 1 programs
# instead: the torch path above is ~20 small kernels (sort, scatter, cumsums, searchsorted),
# each a graph node with its own launch gap, which at batch 1 cost more than the expert
# GEMMs (H200 profiles of Qwen3-30B-A3B and DeepSeek-V2-Lite). 2048 pairs is 256 tokens of
# Qwen3-30B-A3B's 8 slots; past it a program's [pairs] vectors grow long, and the torch
# path's sort takes over.
SMALL_PAIRS = 2048
SMALL_EXPERTS = 512


@triton.jit
def _align_small_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, routed_k, num_experts,
    num_shared, capacity, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
    SEG_BLOCKS: tl.constexpr, FILL: tl.constexpr, COUNTS: tl.constexpr, PDL: tl.constexpr,
):
    # Program e < E lays out expert e's segment; program E fills the rows and blocks past
    # the last segment. Every program counts all experts (a histogram of the ids) to know
    # where its segment starts, so no program waits on another. A histogram, not an
    # [E, pairs] match, which took 255 registers a thread at 32 tokens x 8 of 128 experts.
    pdl_wait(PDL)
    e = tl.program_id(0)
    pairs = tl.arange(0, P_PAD)
    ids = pair_expert(ids_ptr, pairs, pairs < num_pairs, top_k, routed_k,
                      num_experts - num_shared).to(tl.int32)
    # Out-of-range ids (and the padding past num_pairs) match no expert: they get no row.
    in_range = (ids >= 0) & (ids < num_experts)
    ids = tl.where(in_range, ids, E_PAD)
    experts = tl.arange(0, E_PAD)
    counts = tl.histogram(tl.where(in_range, ids, 0), E_PAD, mask=in_range)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    if e < num_experts:
        mine = experts == e
        start = tl.sum(tl.where(mine, ends - padded, 0), axis=0)
        count = tl.sum(tl.where(mine, counts, 0), axis=0)
        end = tl.sum(tl.where(mine, ends, 0), axis=0)
        # A pair's row: the segment start plus how many earlier pairs chose e, so the
        # segment stays in token order (as the stable sort of the torch path).
        hit = (ids == e).to(tl.int32)
        tl.store(sorted_ptr + start + tl.cumsum(hit, axis=0) - hit, pairs, mask=hit != 0)
        pad = start + count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + pad, tl.full([BLOCK_M], 0, tl.int32) + num_pairs, mask=pad < end)
        blocks = start // BLOCK_M + tl.arange(0, SEG_BLOCKS)
        tl.store(block_expert_ptr + blocks, tl.full([SEG_BLOCKS], 0, tl.int32) + e,
                 mask=blocks < end // BLOCK_M)
    else:
        total = tl.sum(padded, axis=0)
        for r0 in range(total, capacity, FILL):
            rows = r0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + rows, tl.full([FILL], 0, tl.int32) + num_pairs,
                     mask=rows < capacity)
        for b0 in range(total // BLOCK_M, capacity // BLOCK_M, FILL):
            blocks = b0 + tl.arange(0, FILL)
            tl.store(block_expert_ptr + blocks, tl.full([FILL], -1, tl.int32),
                     mask=blocks < capacity // BLOCK_M)
        if COUNTS:
            for b0 in range(0, capacity // BLOCK_M, FILL):
                blocks = b0 + tl.arange(0, FILL)
                tl.store(counts_ptr + blocks, tl.full([FILL], 0, tl.int32),
                         mask=blocks < capacity // BLOCK_M)


def _align_small(
    ids: torch.Tensor, num_pairs: int, top_k: int, num_experts: int, num_shared: int, block_m: int,
    capacity: int, block_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    p_pad = triton.next_power_of_2(num_pairs)
    _align_small_kernel[(num_experts + 1,)](
        ids, sorted_pairs, block_expert, block_expert if block_counts is None else block_counts,
        num_pairs, top_k, top_k - num_shared, num_experts, num_shared, capacity,
        BLOCK_M=block_m, P_PAD=p_pad, E_PAD=triton.next_power_of_2(num_experts),
        SEG_BLOCKS=triton.next_power_of_2(triton.cdiv(num_pairs, block_m)), FILL=1024,
        COUNTS=block_counts is not None, num_warps=4, **pdl_options(ids.device),
    )
    return sorted_pairs, block_expert
