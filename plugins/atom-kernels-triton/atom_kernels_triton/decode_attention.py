"""Paged decode attention: one query token per sequence, GQA-grouped, split over the KV.

A program owns (sequence, kv head, split): the query heads sharing that kv head form the
rows of one tile (padded to 16 for tl.dot), so each K/V tile is read once per group, not
once per query head. Splits divide each sequence's context at run time (from the seq_lens
tensor), so a fixed grid - what a CUDA graph needs - fills the GPU at batch 1 and short
contexts leave the surplus splits empty. Partial results carry their log-sum-exp in fp32,
and the last split of a (sequence, kv head) to finish merges them in the same launch,
saving a merge kernel's launch and gap a layer in batch-1 decode graphs.

Everything the kernels read about the batch is in tensors; nothing depends on host values
but the grid, which depends only on tensor shapes.

The cache may be float8_e4m3fn: each K/V tile is converted to the query's dtype as it is
loaded, the K scale is folded into the softmax scale and the V scale into each split's
output, and the fused input stores the new row over its scales, saturated (kv_cache.py's
``to_cache``), and attends to that stored value; so the result is attention over the
dequantized cache either way. For a cache of the query's dtype the conversions are no-ops
and the scales are not read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_kernels_triton.kv_cache import (
    TensorDescriptor,
    cache_descriptors,
    computes_in_f16,
    prefers_tma_pages,
    to_cache,
)
from atom_kernels_triton.occupancy import resident_programs
from atom_kernels_triton.pdl import pdl_options, pdl_wait
from atom_kernels_triton.qk_norm_rope import norm_rope_rows

# Arrival counters, one per (sequence, kv head), keyed by (device, capacity). Each launch
# leaves every counter it used back at 0 (the merging program resets it), so a buffer is
# zeroed once at allocation and never again - a memset would be one more graph node. One
# buffer serves every layer: layers run one after another on one stream, so no two
# launches count in it at once. Buffers are never freed, because a captured CUDA graph
# keeps the address it was captured with and replays against it.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}

# From this many splits on, each program has a tile or two and the kernel is bound by its
# chain of dependent loads: it loads its first tile before pdl_wait (``PRELOAD``). That
# speeds batch-1 decode but slowed the grids of 2-4 splits of several tiles each (batch 32)
# on the H200, so fewer splits keep the plain loop.
PRELOAD_MIN_SPLITS = 8

Tile = tuple[int, int, int]  # (BLOCK_N, num_warps, num_stages)

# The tiles of an fp8 cache's grids that do not preload. The wide one is the default; the
# narrow one holds fewer registers (110-116 a thread against ~150 on an H100: 4 programs an
# SM against 3), so more of a large grid runs at once. Chosen by ``fit_fp8_grid``.
FP8_TILE: Tile = (64, 4, 3)
FP8_NARROW_TILE: Tile = (32, 4, 3)
# With K/V loaded by TMA, the most waves of the wide tile a grid may take and still switch
# to the narrow one: past a few waves the GPU's bandwidth is saturated, and the wide tile's
# bulk copies move more bytes an SM (``fit_fp8_grid``).
TMA_NARROW_MAX_WAVES = 3
# fit_fp8_grid's answers in paged_decode_attention, by kernel variant and grid.
_FP8_GRIDS: dict[tuple, tuple[int, Tile]] = {}


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    capacity = max(64, triton.next_power_of_2(needed))  # few distinct buffers
    buf = _COUNTERS.get((device, capacity))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A zeros() here would be captured, not run: the buffer would start as garbage.
            raise RuntimeError(
                "decode attention counters must be allocated by a warm-up run outside graph "
                "capture"
            )
        buf = torch.zeros(capacity, dtype=torch.int32, device=device)
        _COUNTERS[(device, capacity)] = buf
    return buf


@triton.jit
def _merge_splits(
    po_ptr, plse_ptr, part0, n_active, out_ptrs, hmask, omask, sink,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Weights every written split by its share of the total softmax mass, in split order.
    With HAS_SINKS, ``sink`` ([BLOCK_H], base 2 like the lse) joins that mass as one more
    split whose output is zero.

    A fixed order makes the result independent of which program arrives last. Loads go
    through L2 (.cg): the partials were written by other SMs.
    """
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = hmask[:, None] & (offs_s < n_active)[None, :]
    lse = tl.load(plse_ptr + part0[:, None] + offs_s[None, :], mask=smask, other=float("-inf"),
                  cache_modifier=".cg")
    if BLOCK_S <= 4:
        # Few splits: all partials in one load, issued with the lse's - one round trip for
        # the merging program rather than one per split.
        parts = ((part0[:, None] + offs_s[None, :]) * BLOCK_D)[:, :, None] + offs_d[None, None, :]
        o = tl.load(po_ptr + parts, mask=smask[:, :, None] & omask[:, None, :], other=0.0,
                    cache_modifier=".cg")
    m = tl.max(lse, axis=1)
    if HAS_SINKS:
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence (padding row): all zero
    w = tl.exp2(lse - m[:, None])
    total = tl.sum(w, axis=1)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    if BLOCK_S <= 4:
        acc = tl.sum(o * w[:, :, None], axis=1)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for i in range(0, n_active):
            lse_i = tl.load(plse_ptr + part0 + i, mask=hmask, other=float("-inf"),
                            cache_modifier=".cg")
            o_i = tl.load(po_ptr + (part0 + i)[:, None] * BLOCK_D + offs_d[None, :], mask=omask,
                          other=0.0, cache_modifier=".cg")
            acc += o_i * tl.exp2(lse_i - m)[:, None]
    res = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptrs, res.to(out_ptrs.dtype.element_ty), mask=omask)


@triton.jit
def _scores(q, k, nmask, m, l_sum, qk_scale, PRECISION: tl.constexpr, MAYBE_EMPTY: tl.constexpr,
            MASKED: tl.constexpr = True):
    """One K tile's step of an online softmax: (p, the rescale of what came before, the new
    running max and sum). Without MASKED the tile is whole (``nmask`` unused)."""
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, axis=1))
    m_ref = m_new
    if MAYBE_EMPTY:  # an all-masked first tile must leave the state at zero, not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_ref[:, None])
    alpha = tl.exp2(m - m_ref)
    return p, alpha, m_new, l_sum * alpha + tl.sum(p, axis=1)


@triton.jit
def _tile_rows(bt_row, n0, end, kvh, block_size, stride_blk, stride_slot, stride_head,
               BLOCK_N: tl.constexpr):
    """Where tokens n0..n0+BLOCK_N of a sequence (those < end) sit in the cache, for kv head
    kvh: an offset per token, from the sequence's block table."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_row + offs_n // block_size, mask=offs_n < end, other=0).to(tl.int64)
    return blk * stride_blk + (offs_n % block_size) * stride_slot + kvh * stride_head


@triton.jit
def _kv_tile(k_ptr, v_ptr, rows, n0, end, offs_d, dmask, BLOCK_N: tl.constexpr,
             DTYPE: tl.constexpr):
    """Tokens n0..n0+BLOCK_N of a sequence (those < end), whose cache offsets are ``rows``:
    K, V (in DTYPE, the compute dtype), the token mask, the tokens, and the offsets and mask
    the K/V loads used.

    K and V are loaded together from one offset tensor. This exact form ran faster in the
    model on an H200 (bench/decode_latency.py) than the loop written inline, each load
    forming its own pointers, whether V was loaded before or after the scores; the cause
    was not isolated, and the kernel timed alone (bench/decode_attention.py) does not show
    it. Check end to end before reshaping it."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    kv_ptrs = rows[:, None] + offs_d[None, :]
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(DTYPE)
    v = tl.load(v_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(DTYPE)
    return k, v, nmask, offs_n, kv_ptrs, kv_mask


@triton.jit
def _async_proxy_fence():
    """Orders this thread's earlier global writes (generic proxy) before later reads of them
    by the copy engine (async proxy, TMA): PTX's ``fence.proxy.async.global``, sm_90 on."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _with_new_row(k, v, k_new, v_new, offs_n, seq_len):
    """The tile with the sequence's newest row (token seq_len - 1) taken from k_new/v_new."""
    is_new = (offs_n == seq_len - 1)[:, None]
    return tl.where(is_new, k_new, k), tl.where(is_new, v_new, v)


@triton.jit
def _decode_kernel(
    q_ptr, q_stride_t, q_stride_h,
    k_ptr, v_ptr, k_desc, v_desc, stride_blk, stride_slot, stride_head,
    bt_ptr, bt_stride, seq_lens_ptr, qsl_ptr, seq_idx_ptr,
    out_ptr, out_stride_t, out_stride_h,
    po_ptr, plse_ptr, count_ptr,
    sm_scale, block_size, head_dim, fresh, v_scale, k_inv, v_inv,
    kn_ptr, kn_stride, vn_ptr, vn_stride, qw_ptr, kw_ptr, eps, pos_ptr, cs_ptr, cs_stride,
    rot_dim, slot_ptr, sinks_ptr, window,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr, PRECISION: tl.constexpr, PRELOAD: tl.constexpr,
    FUSED_INPUT: tl.constexpr, IS_NEOX: tl.constexpr, PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, F16: tl.constexpr, TMA: tl.constexpr,
    PROXY_FENCE: tl.constexpr,
):
    """F16 (an fp8 cache under a 16-bit query): K/V tiles are converted to fp16, which holds
    every e4m3 value exactly and converts from it in one instruction a pair (bf16 takes
    several), and q, times the softmax scale, is rounded to fp16 once, before the loop.

    FUSED_INPUT: q_ptr and kn_ptr/vn_ptr are the qkv projection's raw output. Every
    program norms and rotates its query heads itself; the program whose split holds the
    sequence's newest row computes that token's K/V (norm and RoPE on k), stores them in the
    cache before its loop reads them (a CTA barrier orders its own threads), and patches them
    into a tile it preloaded before the store: as stored, so from an fp8 cache the
    saturated value over its scale, converted back as every loaded tile is (sm_scale holds
    the K scale, ``v_scale`` multiplies the output). That is Qwen3's attention input
    (``qk_norm_rope_cache_write``) without its own launch. The loop's tiles are not patched
    in registers: an op between a load and its tl.dot stops Triton pipelining the loads.

    Before ``pdl_wait`` every program reads the batch metadata and its first tile's block
    table entries; the preloading grids also the tile itself. The loop then reads each next
    tile's block table entries one iteration ahead: read in the iteration that uses them,
    they cost a dependent round trip per tile, and Triton's pipeliner does not hoist them.

    TMA (pages holding whole tiles, no window, no preload): the loop's tiles are loaded by
    the copy engine from ``k_desc``/``v_desc``, descriptors of the cache as [blocks * page,
    kv_heads * head_dim] rows, with no address arithmetic in registers. A split's last tile,
    the one that may be partial, is taken first, masked; every tile of the loop after it is
    whole and unmasked. The fused input's new row reaches that tile through the cache: its
    store is a generic-proxy write, so the storing threads fence it against the copy
    engine's (async-proxy) reads before the barrier (``PROXY_FENCE``, compiled kernels; the
    interpreter has neither proxies nor inline asm). Patching the row into the tile from
    registers instead cost registers (sm_90, Triton 3.6: 211 against 128 for the 64-key fp8
    tile).

    HAS_WINDOW: the query (token seq_len - 1) sees only the last ``window`` tokens, and the
    splits divide those alone. HAS_SINKS: each query head's ``sinks_ptr`` logit joins its
    softmax denominator - in the one split's normalization, or in the merge of the splits.
    Without them the kernel is the one compiled before either existed."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # What K/V tiles are computed in, whatever the cache holds.
    DTYPE = tl.float16 if F16 else q_ptr.dtype.element_ty
    if HAS_SEQ_IDX:
        # A negative entry is padding (a captured step's unused decode capacity): it reads
        # sequence 0 as an empty context and stores nothing. Masks, not an early return,
        # keep the control flow the other grids were tuned with.
        entry = tl.load(seq_idx_ptr + b)
        s = tl.maximum(entry, 0)
        seq_len = tl.where(entry >= 0, tl.load(seq_lens_ptr + s), 0)
    else:
        s = b
        seq_len = tl.load(seq_lens_ptr + s)
    row = tl.load(qsl_ptr + s).to(tl.int64)  # this sequence's query row in the flat batch
    # Split length rounded to whole tiles; splits past the context end do no work.
    if HAS_WINDOW:
        # Keys before the window: no split covers them.
        lo = tl.maximum(seq_len - window, 0)
        split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * split_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < GROUP
    dmask = offs_d < head_dim
    heads = kvh * GROUP + offs_h
    bt_row = bt_ptr + s.to(tl.int64) * bt_stride
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp
    first = start
    if not TMA:
        rows = _tile_rows(bt_row, start, end, kvh, block_size, stride_blk, stride_slot,
                          stride_head, BLOCK_N)
    if PRELOAD:
        # Latency-bound grids (many splits, a tile or two each) load before pdl_wait what no
        # kernel of the step writes (pdl.py): the metadata, and the first K/V tile, whose
        # rows earlier steps wrote - all but the sequence's newest ``fresh`` rows, which the
        # kernel before this one may be writing now (more than one where a sequence's draft
        # tokens run as decode rows of their own). They are reloaded after the wait, from L2.
        k, v, nmask, offs_n, kv_ptrs, kv_mask = _kv_tile(
            k_ptr, v_ptr, rows, start, end, offs_d, dmask, BLOCK_N, DTYPE
        )
        first = start + BLOCK_N
        rows = _tile_rows(bt_row, first, end, kvh, block_size, stride_blk, stride_slot, stride_head,
                          BLOCK_N)
    if FUSED_INPUT:
        cs = cs_ptr + tl.load(pos_ptr + row).to(tl.int64) * cs_stride
        slot = tl.load(slot_ptr + row)
    pdl_wait(PDL)
    if PRELOAD:
        if not FUSED_INPUT:
            newest = kv_mask & (offs_n >= seq_len - fresh)[:, None]
            k = tl.where(newest, tl.load(k_ptr + kv_ptrs, mask=newest, other=0.0,
                                         cache_modifier=".cg").to(DTYPE), k)
            v = tl.where(newest, tl.load(v_ptr + kv_ptrs, mask=newest, other=0.0,
                                         cache_modifier=".cg").to(DTYPE), v)
    # Splits 0..n_active-1 hold tokens. In the preloading (many-split) grids the others leave
    # here, past the wait (pdl.py), rather than run over an empty range and count toward the
    # merge (at 576 tokens, 23 of 32 splits are empty); split 0 stays for an empty sequence,
    # to merge its zeros. The other grids keep structured control flow: this early return
    # slowed them (Qwen3-8B at batch 32, 2 splits).
    if HAS_WINDOW:
        n_active = tl.cdiv(seq_len - lo, tl.maximum(split_len, 1))
    else:
        n_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))
    if PRELOAD:
        if split >= tl.maximum(n_active, 1):
            return
    if FUSED_INPUT:
        q = norm_rope_rows(q_ptr + row * q_stride_t + kvh * GROUP * head_dim, hmask, qw_ptr, eps,
                           cs, head_dim, rot_dim, IS_NEOX, BLOCK_H, BLOCK_D)
        k_new = to_cache(norm_rope_rows(kn_ptr + row * kn_stride + kvh * head_dim,
                                        tl.arange(0, 1) < 1, kw_ptr, eps, cs, head_dim, rot_dim,
                                        IS_NEOX, 1, BLOCK_D), k_ptr, k_inv)
        v_new = to_cache(tl.load(vn_ptr + row * vn_stride + kvh * head_dim + offs_d[None, :],
                                 mask=dmask[None, :], other=0.0), v_ptr, v_inv)
        # This split owns the new row.
        if (start <= seq_len - 1) & (seq_len - 1 < end) & (slot >= 0):
            dst = ((slot // block_size) * stride_blk + (slot % block_size) * stride_slot
                   + kvh * stride_head)
            tl.store(k_ptr + dst + offs_d[None, :], k_new, mask=dmask[None, :])
            tl.store(v_ptr + dst + offs_d[None, :], v_new, mask=dmask[None, :])
        if PROXY_FENCE:
            _async_proxy_fence()  # and the copy engine's (TMA) loads of the tail tile
        tl.debug_barrier()  # the loop's loads by other threads see the row (same CTA)
    else:
        q = tl.load(
            q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
            mask=hmask[:, None] & dmask[None, :], other=0.0,
        )
    if F16:
        # Scaled before the rounding, q may reach 65504 / qk_scale (5e5 at head dim 128)
        # before fp16 overflows, not 65504.
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    if PRELOAD:
        if FUSED_INPUT:
            # The row as the loop would read it back from the cache.
            k, v = _with_new_row(k, v, k_new.to(DTYPE), v_new.to(DTYPE), offs_n, seq_len)
        p, alpha, m, l_sum = _scores(q, k, nmask, m, l_sum, qk_scale, PRECISION, True)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    if TMA:
        # Descriptor offsets are 32-bit; the engine's decode steps pass int64 lengths.
        col = (kvh * head_dim).to(tl.int32)  # the kv head's first column of the rows
        # The split's last tile: start is a whole number of tiles into a page.
        tail = tl.where(end > start, start + (end - 1 - start) // BLOCK_N * BLOCK_N, start)
        if end > start:
            key = (tl.load(bt_row + tail // block_size) * block_size
                   + tail % block_size).to(tl.int32)
            k = k_desc.load([key, col]).to(DTYPE)
            v = v_desc.load([key, col]).to(DTYPE)
            nmask = tail + tl.arange(0, BLOCK_N) < end
            # Slots past the context were never written: a NaN there times p = 0 is NaN.
            v = tl.where(nmask[:, None], v, 0.0).to(DTYPE)
            p, alpha, m, l_sum = _scores(q, k, nmask, m, l_sum, qk_scale, PRECISION, False)
            acc = acc * alpha[:, None] + tl.dot(p.to(DTYPE), v, input_precision=PRECISION)
        for n0 in range(start, tail, BLOCK_N):
            key = (tl.load(bt_row + n0 // block_size) * block_size + n0 % block_size).to(tl.int32)
            k = k_desc.load([key, col]).to(DTYPE)
            v = v_desc.load([key, col]).to(DTYPE)
            p, alpha, m, l_sum = _scores(q, k, None, m, l_sum, qk_scale, PRECISION, False,
                                         False)
            acc = acc * alpha[:, None] + tl.dot(p.to(DTYPE), v, input_precision=PRECISION)
    else:
        for n0 in range(first, end, BLOCK_N):
            next_rows = _tile_rows(bt_row, n0 + BLOCK_N, end, kvh, block_size, stride_blk,
                                   stride_slot, stride_head, BLOCK_N)
            k, v, nmask, _, _, _ = _kv_tile(k_ptr, v_ptr, rows, n0, end, offs_d, dmask, BLOCK_N,
                                            DTYPE)
            p, alpha, m, l_sum = _scores(q, k, nmask, m, l_sum, qk_scale, PRECISION, False)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            rows = next_rows

    if HAS_SINKS:
        # exp(sink) in the softmax's base-2 units: the split's scores were scaled by log2(e).
        sink = tl.load(sinks_ptr + heads, mask=hmask, other=float("-inf")).to(tl.float32)
        sink = sink * 1.4426950408889634
    if HAS_SINKS and NUM_SPLITS == 1:
        # The sink's share of the denominator, relative to this row's max as l_sum is (an
        # empty context: max 0, and the row is zero).
        l_sum += tl.exp2(sink - tl.where(m == float("-inf"), 0.0, m))
    safe_l = tl.where(l_sum > 0, l_sum, 1.0)
    o = acc / safe_l[:, None]
    if v_ptr.dtype.element_ty == tl.float8e4nv:
        o = o * v_scale  # every split alike, so the merge of the partials is unchanged
    omask = hmask[:, None] & dmask[None, :]
    if HAS_SEQ_IDX:
        omask = omask & ((offs_h * 0 + entry) >= 0)[:, None]
    out_ptrs = out_ptr + row * out_stride_t + heads[:, None] * out_stride_h + offs_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        part0 = (b.to(tl.int64) * num_heads + heads) * NUM_SPLITS  # [BLOCK_H]: split 0's slot
        # Only splits that hold tokens write partials (an empty sequence: none).
        if split < n_active:
            tl.store(po_ptr + (part0 + split)[:, None] * BLOCK_D + offs_d[None, :], o, mask=omask)
            lse = tl.where(l_sum > 0, m + tl.log2(safe_l), float("-inf"))  # base 2
            tl.store(plse_ptr + part0 + split, lse, mask=hmask)
        # Every split still running counts (all NUM_SPLITS, or in preloading grids the
        # n_active, at least 1, that did not leave; each computes the same count from
        # seq_len), so an empty sequence is still merged, to zeros. The barrier orders all
        # threads' partial stores before the atomic (one thread's release); acq_rel at gpu
        # scope publishes them to, and makes them visible in, whichever program arrives
        # last. (TRITON_INTERPRET runs programs one at a time, so CPU tests check the
        # counting, not this ordering.)
        arrivals = tl.maximum(n_active, 1) if PRELOAD else NUM_SPLITS
        tl.debug_barrier()
        counter = count_ptr + b * tl.num_programs(1) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
            _merge_splits(po_ptr, plse_ptr, part0, n_active, out_ptrs, hmask, omask,
                          sink if HAS_SINKS else m, BLOCK_H, BLOCK_S, BLOCK_D, HAS_SINKS)
            tl.store(counter, 0)  # every split has arrived: ready for the next launch


def fit_fp8_grid(programs: int, num_splits: int, resident: Callable[[Tile], int],
                 tma: bool = False) -> tuple[int, Tile]:
    """(splits, tile) of a decode grid over an fp8 cache: ``programs`` (sequence, kv head)
    pairs, at most ``num_splits`` splits each, where ``resident(tile)`` programs of that
    tile's kernel run at once on the GPU; ``tma``: the kernel loads K/V tiles by TMA.

    A grid larger than what runs at once takes a second wave, and every wave is a whole
    chain of dependent tile loads. So a split grid past one wave of the default tile runs
    unsplit where the unsplit grid fills at least half of that wave (no partials to merge
    either), and an unsplit grid past one wave takes the narrow tile where that needs fewer
    waves (by TMA, only while the wide tile needs at most ``TMA_NARROW_MAX_WAVES``). In the
    model on an H100, K/V by pointer (``bench/decode_latency.py --quantization fp8
    --kv-cache-dtype fp8``, Qwen3-8B; 3 programs an SM of the wide tile, 4 of the narrow;
    bench/RESULTS.md): batch 32 unsplit instead of two splits 5.44 -> 5.24 ms, batch 64 on
    the narrow tile 6.38 -> 5.57 ms, batch 128 9.02 -> 8.40 ms. Where both tiles fit one
    wave (batch 40, 48) or need as many (80, 96) the wide one was faster. Halving batch
    16's four splits to two, so that it fit, was slower (4.99 -> 5.14 ms), and batch 24
    unsplit (its 192 programs under half a wave) slower than at its two splits (5.18
    against 4.79 ms). By pointer the narrow tile also won at ~512 sequences (the offline
    bench's decode steps, 35.74 -> 33.76 ms). By TMA it lost there: 512 sequences of 1,100
    tokens (11 waves wide, 8 narrow) took 470.5 us a layer on the wide tile against 526.7
    on the narrow one (``bench/decode_attention.py --block-size 64 --kv-dtype fp8
    --fused-input --tma 1 --shapes "qwen3-8b bs512 ctx1100"``, H100); in the model the
    offline bench's decode steps went 29.25 -> 27.20 ms with the wide tile.

    Both tiles' residencies are asked for every grid: asking compiles that tile's kernel
    (``resident_programs`` through Triton's warmup), so the first grid of a kernel variant,
    the engine's warm-up's, compiles the narrow one too. Asked only where a grid needs it,
    the offline bench compiled it inside its timed run (0.55 s, H100, fp8)."""
    fit = resident(FP8_TILE)
    narrow = resident(FP8_NARROW_TILE)
    if num_splits > 1 and programs * num_splits > fit and 2 * programs >= fit:
        num_splits = 1
    grid = programs * num_splits
    if num_splits == 1 and fit < grid and not (tma and grid > TMA_NARROW_MAX_WAVES * fit):
        if triton.cdiv(grid, narrow) < triton.cdiv(grid, fit):
            return 1, FP8_NARROW_TILE
    return num_splits, FP8_TILE


def num_kv_splits(num_seqs: int, num_kv_heads: int, num_sms: int, waves: int = 4) -> int:
    """Splits per (sequence, kv head) so that about ``waves`` programs per SM fill the GPU.

    A function of the batch shape only, so a captured graph and an eager step of the same
    batch size split alike. 4 by default, from bench/decode_attention.py on an H200:
    splitting pays until about that many programs per SM; from ~2 programs per SM on it
    only adds partials to merge.
    """
    programs = max(1, num_seqs * num_kv_heads)
    if 2 * programs >= waves * num_sms:
        return 1
    # A power of two (each value is a compiled variant), at most 32.
    want = triton.cdiv(waves * num_sms, programs)
    return min(32, 1 << (want.bit_length() - 1))


class NewTokenInput(NamedTuple):
    """What turns the qkv projection's raw output into the attention input: per-head RMSNorm
    of q and k, RoPE, and the K/V cache write (``qk_norm_rope_cache_write``'s arguments)."""

    k: torch.Tensor  # [T, kv_heads * D] raw, rows of stride(0), unit column stride
    v: torch.Tensor  # [T, kv_heads * D]
    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    eps: float
    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_position, rot_dim] fp32: cos then sin
    slot_mapping: torch.Tensor  # [T]; -1 stores nothing
    is_neox: bool


def paged_decode_attention(
    q: torch.Tensor,  # [T, H, D]; row query_start_loc[s] is sequence s's query
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, D]; q's dtype or fp8 e4m3
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    out: torch.Tensor,  # [T, H, D], written at the decode rows
    scale: float,
    num_splits: int,
    seq_idx: torch.Tensor | None = None,  # a mixed batch's decodes only; -1 is padding
    tile: tuple[int, int, int] | None = None,  # (BLOCK_N, num_warps, num_stages): tuning only
    new_tokens: NewTokenInput | None = None,
    fresh: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [H] per-head logits joining each softmax
    sliding_window: int | None = None,  # the query sees only its sequence's last this many
    f16: bool | None = None,  # the kernel's F16, where not the default rule: tuning only
    fit_grid: bool = False,
    tma: bool | None = None,  # K/V by TMA where the layout allows; None: the device's rule
) -> None:
    """Attention of each decode row's query over its sequence's cached K/V, into ``out``;
    an fp8 cache's K and V read times ``k_scale`` and ``v_scale``. ``sinks`` and
    ``sliding_window`` as ``AttentionBackend`` defines them; fixed per layer, they are
    launch arguments, so a captured graph replays them.

    With ``new_tokens``, q is the raw projection output and the kernel also does Qwen3's
    attention input (see ``_decode_kernel``); the result equals running
    ``qk_norm_rope_cache_write`` first. Without it, the cache already holds the new K/V.
    ``fresh``: how many of each context's last rows the step writes (the newest; more where
    a sequence's drafts are decode rows of their own): none is read before the PDL wait.

    ``fit_grid``: ``num_splits`` is an upper bound; over an fp8 cache on a GPU a grid of
    fewer splits or narrower tiles may run (``fit_fp8_grid``), where ``tile`` is not given.
    The model's backend passes it; without it the grid is exactly as asked.

    ``tma``: load K/V tiles by TMA (``_decode_kernel``'s ``TMA``) wherever the layout allows
    (the interpreter too): a page holding whole tiles, 16-bit queries, no window, a grid
    that does not preload. None: where the device prefers it (``prefers_tma_pages``, as
    prefill does); False: by pointer."""
    if sinks is not None and sinks.stride(0) != 1:
        raise ValueError("attention sinks must be contiguous: the kernel reads sinks[head]")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_idx.shape[0] if seq_idx is not None else seq_lens.shape[0]
    if num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(max(head_dim, 16))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if f16 is None:
        f16 = computes_in_f16(q, kv_cache)
    idx = seq_idx if seq_idx is not None else seq_lens
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8:
        scale = scale * k_scale  # q . (stored * k_scale) == (q . stored) * k_scale
    fused = new_tokens is not None
    if fused:
        kn, vn = new_tokens.k, new_tokens.v
        if q.stride(1) != head_dim or q.stride(2) != 1 or kn.stride(1) != 1 or vn.stride(1) != 1:
            raise ValueError("fused decode attention needs heads contiguous within each row")
        if not kv_cache.is_contiguous():
            raise ValueError("fused decode attention writes slots of a contiguous cache")
        nt = new_tokens
        extra = (kn, kn.stride(0), vn, vn.stride(0), nt.q_weight, nt.k_weight, nt.eps, nt.positions,
                 nt.cos_sin_cache, nt.cos_sin_cache.stride(0), nt.cos_sin_cache.shape[-1],
                 nt.slot_mapping)
    else:
        extra = (q, 0, q, 0, q, q, 0.0, seq_lens, q, 0, 0, seq_lens)  # unused

    if tma is None:
        tma = prefers_tma_pages(q.device, head_dim)
    tma = (tma and TensorDescriptor is not None and block_d == head_dim
           and sliding_window is None and q.dtype in (torch.float16, torch.bfloat16)
           and kv_cache.is_contiguous())

    def by_tma(splits: int, tile: Tile) -> bool:
        """Whether this grid's K/V tiles load by TMA: pages holding whole tiles, no preload."""
        return tma and splits < PRELOAD_MIN_SPLITS and block_size % tile[0] == 0

    def launch(splits: int, po: torch.Tensor, plse: torch.Tensor, counters: torch.Tensor,
               tile: Tile) -> tuple[tuple, dict]:
        """The kernel's arguments and compile-time options for this grid and tile."""
        tiled = by_tma(splits, tile)
        descs = cache_descriptors(kv_cache, tile[0]) if tiled else (k_cache, v_cache)
        args = (
            q, q.stride(0), q.stride(1),
            k_cache, v_cache, *descs, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables, block_tables.stride(0), seq_lens, query_start_loc, idx,
            out, out.stride(0), out.stride(1), po, plse, counters,
            scale, block_size, head_dim, fresh, v_scale, 1.0 / k_scale, 1.0 / v_scale, *extra,
            sinks if sinks is not None else q, sliding_window or 0,
        )
        consts = dict(
            NUM_SPLITS=splits, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
            BLOCK_N=tile[0], BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(splits), HAS_SEQ_IDX=seq_idx is not None,
            PRECISION=precision, PRELOAD=splits >= PRELOAD_MIN_SPLITS, FUSED_INPUT=fused,
            IS_NEOX=new_tokens.is_neox if fused else True,
            HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window is not None, F16=f16,
            TMA=tiled, PROXY_FENCE=tiled and fused and q.device.type == "cuda",
            num_warps=tile[1], num_stages=tile[2], **pdl_options(q.device),
        )
        return args, consts

    # 8 warps for the latency-bound (preloading) grids, the faster at batch 1
    # (bench/decode_attention.py). An fp8 cache's tiles are half the bytes: a third stage
    # keeps as many in flight (bench/decode_attention.py --kv-dtype fp8 on an H100: 0.80x
    # two stages' time at 512 sequences, 0.64x at 64).
    if q.dtype == torch.float32:
        default = (32, 4, 2)
    elif num_splits >= PRELOAD_MIN_SPLITS:
        default = (64, 8, 2)
    elif fp8:
        default = FP8_TILE
        if fit_grid and tile is None and q.device.type == "cuda":
            # Decided once per kernel variant and grid: an eager step would otherwise pay
            # the residency lookup (a pass over every argument) in every layer.
            key = (q.device, q.dtype, group, block_d, fused, seq_idx is not None,
                   sinks is not None, sliding_window is not None, f16, tma, block_size,
                   num_seqs * num_kv_heads, num_splits)
            if key not in _FP8_GRIDS:
                # Residency of the one-split kernel (``out`` stands for the unused partials,
                # as in its launch); a split grid's kernel holds about as many registers.
                _FP8_GRIDS[key] = fit_fp8_grid(
                    num_seqs * num_kv_heads, num_splits,
                    lambda t: resident_programs(_decode_kernel, *launch(1, out, out, out, t), 64),
                    tma=by_tma(1, FP8_TILE))
            num_splits, tile = _FP8_GRIDS[key]
    else:
        default = (64, 4, 2)
    if num_splits > 1:
        po = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32,
                         device=q.device)
        plse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        counters = _counters(q.device, num_seqs * num_kv_heads)
    else:
        po = plse = counters = out  # unused: one split writes the output directly
    args, consts = launch(num_splits, po, plse, counters, tile or default)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](*args, **consts)
