"""Paged prefill/extend attention for variable-length batches with cached prefixes.

A program owns (query tile, sequence, query head). Sequence s's ``q_len`` queries are the
last of its ``seq_len`` context tokens; K/V of the whole context (cached prefix and the
new tokens, written just before) are read through the block table, causally masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_kernel(
    q_ptr, q_stride_t, q_stride_h,
    k_ptr, v_ptr, stride_blk, stride_slot, stride_head,
    bt_ptr, bt_stride, seq_lens_ptr, qsl_ptr, seq_idx_ptr,
    out_ptr, out_stride_t, out_stride_h,
    sm_scale, block_size, head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    mblk = tl.program_id(0)
    s = tl.load(seq_idx_ptr + tl.program_id(1))
    h = tl.program_id(2)
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
    dmask = offs_d < head_dim
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * q_stride_t + h * q_stride_h + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + offs_m
    qk_scale = sm_scale * 1.4426950408889634

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * bt_stride
    end = tl.minimum(seq_len, ctx + (mblk + 1) * BLOCK_M)  # causal: no key past the last query
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        blk = tl.load(bt_row + offs_n // block_size, mask=nmask, other=0).to(tl.int64)
        off = blk * stride_blk + (offs_n % block_size) * stride_slot + kvh * stride_head
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & nmask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past q_len see nothing
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * out_stride_t + h * out_stride_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, D], new K/V already in
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_idx: torch.Tensor,  # [P] the sequences to compute
    max_query_len: int,
    out: torch.Tensor,  # [T, H, D]
    scale: float,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if seq_idx.shape[0] == 0:
        return
    wide = q.dtype == torch.float32
    block_m = 32 if wide else 64
    block_n = 32 if wide else 64
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_query_len, block_m), seq_idx.shape[0], num_heads)
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0), seq_lens, query_start_loc, seq_idx,
        out, out.stride(0), out.stride(1),
        scale, block_size, head_dim,
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(max(head_dim, 16)),
        PRECISION="ieee" if wide else "tf32", num_warps=4, num_stages=2,
    )
