"""Paged prefill/extend attention for variable-length batches with cached prefixes.

A program owns (query head, sequence, query tile). Sequence s's ``q_len`` queries are the
last of its ``seq_len`` context tokens; K/V of the whole context (cached prefix and the
new tokens, written just before) are read through the block table, causally masked.

Throughput choices (prefill is compute bound; these follow the FlashAttention-2 recipe):
- The KV loop is split in two. Tiles wholly before the tile's first query position are
  visible to every row, so they run with no mask, no ``tl.where`` and unmasked loads;
  only the few tiles on the diagonal pay for the causal/length mask.
- 16-bit inputs use 128x32 tiles, 4 warps and 3 pipeline stages on CUDA (``tile_config``);
  a grid too small to fill the GPU (a prompt chunk beside decodes) 64-row tiles.
- The grid runs heads fastest and query tiles slowest, last tile first: the tiles with
  the most keys (causal work grows with position) start in the first wave, so no long
  tile is left running alone at the end, and the query heads that share a kv head run
  side by side and find its K/V in L2.
- The page size is a compile-time constant: a tile inside one page reads one block id,
  and a tile over several pages finds each key's block with a shift (no integer division).
  K/V offsets keep their 16-element alignment, so loads vectorize and pipeline (cp.async).
- Where the device has TMA and a page holds whole 64-key tiles (``--block-size`` 64 or
  more, the backend's preferred page size there), K/V tiles are loaded by the copy engine
  from descriptors of the cache, with no address arithmetic in registers: 128 x 64 tiles
  then fit 4 warps without spilling.

The cache may be float8_e4m3fn: K/V tiles are converted to the compute dtype as they are
loaded, then computed on as a cache of that dtype would be (a no-op conversion for one),
with the K scale folded into the softmax scale and the V scale into the output. Under a
16-bit query the compute dtype of an fp8 cache is fp16 (``F16``), as in decode attention
(decode_attention.py says why): q, times the softmax scale, is rounded to fp16 once.

GQA is not grouped into one program: rows of (head, position) pairs do the same FLOPs per
K/V tile as rows of positions, so at a fixed tile size it saves no traffic; L2 serves the
sibling heads' re-reads instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels_triton.kv_cache import (
    TensorDescriptor,
    cache_descriptors,
    computes_in_f16,
    prefers_tma_pages,
)
from atom_kernels_triton.occupancy import device_limits


@triton.jit
def _kv_offsets(bt_row, n0, hi, stride_blk, stride_slot,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Cache offsets of keys n0 .. n0 + BLOCK_N (those >= hi only when MASKED)."""
    if PAGE % BLOCK_N == 0:
        # The tile lies inside one page: one block id, contiguous slots.
        blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
        return blk * stride_blk + (n0 % PAGE + tl.arange(0, BLOCK_N)) * stride_slot
    else:
        # Several pages per tile. PAGE is a compile-time constant, so // and % are shifts and
        # masks for the usual powers of two, and the keys of one page read one address (one
        # transaction per page). Not tl.reshape of a per-page load: older Triton loses the
        # offsets' alignment through a reshape and would stop vectorizing the K/V loads.
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            blk = tl.load(bt_row + offs_n // PAGE, mask=offs_n < hi, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        return blk * stride_blk + (offs_n % PAGE) * stride_slot


@triton.jit
def _attend(acc, l_sum, m, q, k_ptr, v_ptr, bt_row, lo, hi, q_pos, qk_scale,
            stride_blk, stride_slot, kv_head_off, offs_d, dmask, window,
            PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            PAD_D: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
            TMA: tl.constexpr):
    """Online softmax over keys [lo, hi); MASKED applies the causal and length masks, and
    with WINDOW the sliding window's (keys > q_pos - window). K/V are computed on in q's
    dtype, whatever the cache holds. TMA: k_ptr and v_ptr are descriptors of the cache as
    [blocks * PAGE, kv_heads * head_dim] rows, each tile inside one page, and
    ``kv_head_off`` the kv head's first column."""
    for n0 in range(lo, hi, BLOCK_N):
        if MASKED:
            offs_n = n0 + tl.arange(0, BLOCK_N)
        if TMA:
            row = tl.load(bt_row + n0 // PAGE) * PAGE + n0 % PAGE
            k = k_ptr.load([row, kv_head_off]).to(q.dtype)
            v = v_ptr.load([row, kv_head_off]).to(q.dtype)
            if MASKED:
                # A page's slots past hi were never written: a NaN there times p = 0 would
                # still reach the sum. K needs no clearing: its scores are masked to -inf.
                v = tl.where((offs_n < hi)[:, None], v, 0.0).to(q.dtype)
        elif MASKED:
            kv_off = _kv_offsets(bt_row, n0, hi, stride_blk, stride_slot, PAGE, BLOCK_N, MASKED)
            ptrs = kv_off[:, None] + kv_head_off + offs_d[None, :]
            kv_mask = (offs_n < hi)[:, None] & dmask[None, :]
            k = tl.load(k_ptr + ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        elif PAD_D:
            kv_off = _kv_offsets(bt_row, n0, hi, stride_blk, stride_slot, PAGE, BLOCK_N, MASKED)
            ptrs = kv_off[:, None] + kv_head_off + offs_d[None, :]
            k = tl.load(k_ptr + ptrs, mask=dmask[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + ptrs, mask=dmask[None, :], other=0.0).to(q.dtype)
        else:
            kv_off = _kv_offsets(bt_row, n0, hi, stride_blk, stride_slot, PAGE, BLOCK_N, MASKED)
            ptrs = kv_off[:, None] + kv_head_off + offs_d[None, :]
            k = tl.load(k_ptr + ptrs).to(q.dtype)
            v = tl.load(v_ptr + ptrs).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            # Keys past hi are past every real row's position; loaded as zeros, they reach
            # only the rows past q_len, which are never stored.
            visible = offs_n[None, :] <= q_pos[:, None]
            if WINDOW:
                visible &= offs_n[None, :] > q_pos[:, None] - window
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
        else:
            qk = qk * qk_scale
        # Without a window every row sees a key in its first tile (see the caller), so m
        # stays finite. A window's masked tiles may hide every key from a row: while its
        # max is -inf, it subtracts 0, so its p and rescale are 0, not NaN.
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        m_ref = m_new
        if MASKED and WINDOW:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return acc, l_sum, m


@triton.jit
def _prefill_kernel(
    q_ptr, q_stride_t, q_stride_h,
    k_ptr, v_ptr, stride_blk, stride_slot, stride_head,
    bt_ptr, bt_stride, seq_lens_ptr, qsl_ptr, seq_idx_ptr,
    out_ptr, out_stride_t, out_stride_h,
    sm_scale, v_scale, sinks_ptr, window,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    F16: tl.constexpr, KV_FP8: tl.constexpr, TMA: tl.constexpr, Q_TMA: tl.constexpr,
):
    """HAS_WINDOW: a query at position p sees keys in (p - window, p]. HAS_SINKS: head h's
    ``sinks_ptr`` logit joins each of its rows' softmax denominators. Without them the
    kernel is the one compiled before either existed. TMA: k_ptr and v_ptr are tensor
    descriptors (``_attend``); Q_TMA: q_ptr too, of q as [tokens, heads * head_dim] rows."""
    h = tl.program_id(0)
    s = tl.load(seq_idx_ptr + tl.program_id(1))
    if s < 0:  # padding: a captured step's unused prompt capacity
        return
    mblk = tl.num_programs(2) - 1 - tl.program_id(2)  # last (longest) tiles launch first
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len  # tokens cached before this step's queries
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < q_len
    dmask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    if Q_TMA:
        # Straight into shared memory, where the QK^T product reads it: loaded by pointer, q
        # would hold 64 registers a thread beside the accumulator. Rows past q_len (the next
        # sequence's, or zeros past the last token) are never stored.
        q = q_ptr.load([q_start + mblk * BLOCK_M, h * HEAD_DIM])
    else:
        q = tl.load(q_ptr + rows[:, None] * q_stride_t + h * q_stride_h + offs_d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + offs_m
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp
    if F16:  # K/V tiles convert to q's dtype: fp16
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * bt_stride
    if TMA:
        kv_head_off = kvh * HEAD_DIM  # a column of the descriptor's rows
    else:
        kv_head_off = kvh * stride_head
    # Keys before `lo` precede the tile's first position: visible to every row (rows past
    # q_len included), all inside the context. From lo to hi the diagonal; lo <= the first
    # row's position < seq_len, so each row sees key lo in the first masked tile.
    first = ctx + mblk * BLOCK_M
    lo = first // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, first + BLOCK_M)  # causal: no key past the last query
    if HAS_WINDOW:
        # Keys before the first row's window are no row's: the loop starts at the tile of
        # that window's first key. From `mid` (at or past the last row's, hi - 1's, window
        # start) to lo, every row sees every key: no mask. Before mid, masked tiles.
        start = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        mid = tl.minimum(tl.cdiv(tl.maximum(hi - window, 0), BLOCK_N) * BLOCK_N, lo)
        acc, l_sum, m = _attend(acc, l_sum, m, q, k_ptr, v_ptr, bt_row, start, mid, q_pos,
                                qk_scale, stride_blk, stride_slot, kv_head_off, offs_d, dmask,
                                window, PAGE, BLOCK_N, True, BLOCK_D != HEAD_DIM, PRECISION,
                                True, TMA)
    else:
        mid = 0
    acc, l_sum, m = _attend(acc, l_sum, m, q, k_ptr, v_ptr, bt_row, mid, lo, q_pos, qk_scale,
                            stride_blk, stride_slot, kv_head_off, offs_d, dmask, window,
                            PAGE, BLOCK_N, False, BLOCK_D != HEAD_DIM, PRECISION, False, TMA)
    acc, l_sum, m = _attend(acc, l_sum, m, q, k_ptr, v_ptr, bt_row, lo, hi, q_pos, qk_scale,
                            stride_blk, stride_slot, kv_head_off, offs_d, dmask, window,
                            PAGE, BLOCK_N, True, BLOCK_D != HEAD_DIM, PRECISION, HAS_WINDOW,
                            TMA)

    if HAS_SINKS:
        # exp(sink) relative to the row's max, in base 2 as the scores (every real row sees
        # its own key, so the max is finite).
        l_sum += tl.exp2(tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634 - m)
    if HAS_WINDOW:
        # A row past q_len may see no key in the window (never stored): 0, not 0 / 0.
        l_sum = tl.where(l_sum > 0, l_sum, 1.0)
    o = acc / l_sum[:, None]
    if KV_FP8:
        o = o * v_scale
    tl.store(out_ptr + rows[:, None] * out_stride_t + h * out_stride_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


# 64-row tiles up to this many 128-row programs an SM: fewer (a step's prompt chunks of up
# to a thousand tokens) leave SMs idle or give each program a long chain of key tiles, which
# halved rows run at twice the programs and half the work a tile. On an H100, graph-timed
# (bench/prefill_attention.py, Qwen3-8B, 64x64 against 128x32 tiles): 1 x 448 new tokens
# 14.5 against 18.5 us, 256 over 256 cached 13.9 against 21, 1 x 1024 33.2 against 43.2.
SMALL_GRID_PROGRAMS_PER_SM = 2


# K/V tiles of this many keys are loaded by TMA where a cache page holds whole tiles.
# bench/prefill_attention.py (Qwen3-8B, bf16, graph-timed): on an H200, 16 x 1024 new tokens
# in 0.444 ms by TMA over pages of 64 against 0.599 by pointer over pages of 16; on an H100,
# by pointer, the same 128 x 64 tiles under 4 warps spilled (0.560 ms against 128 x 32's
# 0.527 over pages of 64).
TMA_BLOCK_N = 64


def tma_page(block_size: int) -> bool:
    """Whether a cache of ``block_size``-token pages takes TMA tiles where the device has
    TMA: each tile must lie inside one page."""
    return block_size % TMA_BLOCK_N == 0


def tile_config(dtype: torch.dtype, block_d: int, small_grid: bool = False,
                smem_per_block: int = 0, tma: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this input dtype and padded head dim;
    ``small_grid``: 128-row tiles would not fill the GPU (``SMALL_GRID_PROGRAMS_PER_SM``),
    on a device whose blocks may use ``smem_per_block`` bytes of shared memory; ``tma``: the
    K/V tiles are loaded by TMA (``TMA_BLOCK_N`` keys, inside one page).

    Compiled for sm_90 (Triton 3.6): the 16-bit configs need at most 96 KiB of shared
    memory, so they also fit Ampere and Ada, but for the small grids' 64x64 tiles (112 KiB),
    which run only where a block may have 128 KiB (sm_80, sm_90; elsewhere 64x32). At head
    dim 128 the CUDA config uses 255 registers and spills 2 (measured faster all the same);
    64 and 256 do not spill.
    """
    if dtype == torch.float32:
        # Exact fp32 dots run on FMAs with operands in registers: small tiles, and 8 warps
        # to spread them (4 spill about three times as much at head dim 128).
        return 32, 32, 8, 2
    if block_d > 128:
        return 64, 32, 8, 2  # 128-row tiles spill; 3 stages of wide K/V overflow shared memory
    if torch.version.hip:
        return 128, 64, 8, 2  # ROCm's pipeliner is tuned for two stages
    if tma:
        # Without address tensors the 128-row tiles fit 4 warps; a small grid's 64-row tiles
        # as below (64 x 64 was the fastest TMA tile at 1 x 448 and 1 x 1024 on an H100).
        return (64 if small_grid else 128), TMA_BLOCK_N, 4, 3
    if small_grid:
        return (64, 64, 4, 3) if smem_per_block >= 128 * 1024 else (64, 32, 4, 3)
    # Narrow K/V tiles under 4 warps: on an H200 (bench/prefill_attention.py, Qwen3-8B
    # shapes, bf16) faster than 128x64 tiles under 8 warps for prefills and extends alike;
    # 4 stages were no better, and 8 warps on these tiles slower. Three stages need 80 KiB
    # of shared memory at head dim 128.
    return 128, 32, 4, 3


def is_small_grid(num_heads: int, num_tokens: int, num_sms: int) -> bool:
    """Whether 128-row tiles over ``num_tokens`` query rows would leave SMs idle. From
    shapes only, so a captured step (its padded token count) decides as its replays do."""
    return num_heads * triton.cdiv(num_tokens, 128) <= SMALL_GRID_PROGRAMS_PER_SM * num_sms


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, D], new K/V already in;
    # q's dtype or float8_e4m3fn
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_idx: torch.Tensor,  # [P] the sequences to compute; -1 is padding
    max_query_len: int,  # the grid's bound: a captured step passes its token count
    out: torch.Tensor,  # [T, H, D]
    scale: float,
    k_scale: float = 1.0,  # an fp8 cache's K and V are read times these
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [H] per-head logits joining each softmax
    sliding_window: int | None = None,  # a query at p sees keys at positions > p - this
    f16: bool | None = None,  # the kernel's F16, where not the default rule: tuning only
    tile: tuple[int, int, int, int] | None = None,  # tile_config's answer instead: tuning only
    tma: bool | None = None,  # K/V by TMA (where possible), where not the default rule: tuning
) -> None:
    """Attention of sequences ``seq_idx``'s queries over their contexts, into ``out``.
    ``sinks`` and ``sliding_window`` as ``AttentionBackend`` defines them, passed as launch
    arguments (fixed per layer: a captured graph replays them)."""
    if sinks is not None and sinks.stride(0) != 1:
        raise ValueError("attention sinks must be contiguous: the kernel reads sinks[head]")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if seq_idx.shape[0] == 0:
        return
    block_d = triton.next_power_of_2(max(head_dim, 16))
    small, smem = False, 0
    if q.device.type == "cuda":
        sms, smem, _ = device_limits(q.device)
        small = is_small_grid(num_heads, q.shape[0], sms)
    if tma is None:
        tma = (q.dtype in (torch.float16, torch.bfloat16) and tma_page(block_size)
               and prefers_tma_pages(q.device, head_dim))
    # A forced tma=True runs descriptors wherever the layout allows: under the interpreter
    # too (the CPU tests).
    tma = (tma and TensorDescriptor is not None and block_d == head_dim
           and q.dtype != torch.float32 and kv_cache.is_contiguous())
    if tile is None:
        tile = tile_config(q.dtype, block_d, small, smem, tma)
    block_m, block_n, warps, stages = tile
    tma = tma and block_size % block_n == 0
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    q_arg, q_tma = q, False
    if tma:
        k_cache, v_cache = cache_descriptors(kv_cache, block_n)
        size = q.element_size()
        q_tma = (q.stride(2) == 1 and q.stride(1) == head_dim and q.data_ptr() % 16 == 0
                 and q.stride(0) * size % 16 == 0)
        if q_tma:
            q_arg = TensorDescriptor(q, [q.shape[0], num_heads * head_dim], [q.stride(0), 1],
                                     [block_m, head_dim])
    if kv_cache.dtype == torch.float8_e4m3fn:
        scale = scale * k_scale  # q . (stored * k_scale) == (q . stored) * k_scale
    if f16 is None:
        f16 = computes_in_f16(q, kv_cache)
    grid = (num_heads, seq_idx.shape[0], triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q_arg, q.stride(0), q.stride(1),
        k_cache, v_cache, kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables, block_tables.stride(0), seq_lens, query_start_loc, seq_idx,
        out, out.stride(0), out.stride(1),
        scale, v_scale, sinks if sinks is not None else q, sliding_window or 0,
        GROUP=num_heads // num_kv_heads, PAGE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window is not None, F16=f16,
        KV_FP8=kv_cache.dtype == torch.float8_e4m3fn, TMA=tma, Q_TMA=q_tma,
        num_warps=warps, num_stages=stages,
    )
