"""Qwen3's attention input in one launch: per-head RMSNorm of q and k, RoPE, and the paged
KV-cache write of k and v. One program per token, all its heads; q, k and v are read once
from the qkv projection's output and k/v written straight into their cache slot (an fp8
cache gets them over their scales, saturated, as kv_cache.py's ``to_cache`` stores them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels_triton.kv_cache import to_cache
from atom_kernels_triton.pdl import pdl_options, pdl_wait
from atom_kernels_triton.rotary import rope_pairs


@triton.jit
def norm_rope_rows(base, hmask, w_ptr, eps, cs_ptr, head_size, rot_dim,
                   IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """RMSNorm then RoPE of the heads at ``base`` (contiguous, head_size apart; rows where
    ``hmask``), in base's dtype [BLOCK_H, BLOCK_D]: exactly what the unfused norm and
    rotary ops store. Decode attention computes its query this way too (decode_attention.py)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_size
    mask = hmask[:, None] & dmask[None, :]
    rows = base + h[:, None] * head_size
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / head_size + eps)
    w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    # Round the norm to the model dtype, as the unfused path stores it, before rotating.
    n = (x * rstd[:, None] * w[None, :]).to(base.dtype.element_ty).to(tl.float32)
    half = rot_dim // 2
    # The partner element is re-read and normed with its own weight and the head's rstd, so
    # no cross-lane shuffle is needed.
    first, partner, freq = rope_pairs(d, rot_dim, IS_NEOX)
    rot = d < rot_dim
    pmask = mask & rot[None, :]
    xp = tl.load(rows + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    np_ = (xp * rstd[:, None] * wp[None, :]).to(base.dtype.element_ty).to(tl.float32)
    cos = tl.load(cs_ptr + freq, mask=rot, other=1.0)
    sin = tl.load(cs_ptr + half + freq, mask=rot, other=0.0)
    sign = tl.where(first, -1.0, 1.0)
    y = tl.where(rot[None, :], n * cos[None, :] + (sign * sin)[None, :] * np_, n)
    return y.to(base.dtype.element_ty)


@triton.jit
def _norm_rope_heads(src, src_stride, w_ptr, eps, dst, cs_ptr, tok, heads, head_size, rot_dim,
                     IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Normed and rotated heads of one token [BLOCK_H, BLOCK_D], also stored to dst."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < heads
    y = norm_rope_rows(src + tok * src_stride, hmask, w_ptr, eps, cs_ptr, head_size, rot_dim,
                       IS_NEOX, BLOCK_H, BLOCK_D)
    mask = hmask[:, None] & (d < head_size)[None, :]
    tl.store(dst + tok * heads * head_size + h[:, None] * head_size + d[None, :],
             y.to(dst.dtype.element_ty), mask=mask)
    return y


@triton.jit
def _qk_norm_rope_cache_kernel(
    pos_ptr, q_ptr, q_stride, k_ptr, k_stride, v_ptr, v_stride, qw_ptr, kw_ptr, eps,
    q_out, k_out, cs_ptr, cs_stride, cache_ptr, v_offset, slot_ptr, q_heads, k_heads,
    head_size, rot_dim, k_inv, v_inv, IS_NEOX: tl.constexpr, BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cs = cs_ptr + pos * cs_stride
    _norm_rope_heads(q_ptr, q_stride, qw_ptr, eps, q_out, cs, tok, q_heads, head_size, rot_dim,
                     IS_NEOX, BLOCK_QH, BLOCK_D)
    k = _norm_rope_heads(k_ptr, k_stride, kw_ptr, eps, k_out, cs, tok, k_heads, head_size,
                         rot_dim, IS_NEOX, BLOCK_KH, BLOCK_D)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # -1: a padding token, not stored
        h = tl.arange(0, BLOCK_KH)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < k_heads) & (d[None, :] < head_size)
        cols = h[:, None] * head_size + d[None, :]
        v = tl.load(v_ptr + tok * v_stride + cols, mask=mask)
        dst = cache_ptr + slot * (k_heads * head_size) + cols
        tl.store(dst, to_cache(k, cache_ptr, k_inv), mask=mask)
        tl.store(dst + v_offset, to_cache(v, cache_ptr, v_inv), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.flatten(1)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def qk_norm_rope_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the native op (atom_core/ops/native/qk_norm_rope.py). One launch,
    grid = number of tokens, no host reads of device values: CUDA-graph capturable."""
    head_size = q_weight.shape[0]
    q2, k2, v2 = _rows(q), _rows(k), _rows(v)
    num_tokens = q2.shape[0]
    q_heads, k_heads = q2.shape[1] // head_size, k2.shape[1] // head_size
    # Slot addressing assumes the dense [2, blocks, block_size, kv_heads, head_dim] layout.
    assert kv_cache.is_contiguous() and kv_cache.shape[-2:] == (k_heads, head_size)
    q_out = torch.empty((num_tokens, q2.shape[1]), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, k2.shape[1]), dtype=k.dtype, device=k.device)
    if num_tokens:
        block_d = triton.next_power_of_2(head_size)
        block_qh = triton.next_power_of_2(q_heads)
        _qk_norm_rope_cache_kernel[(num_tokens,)](
            positions, q2, q2.stride(0), k2, k2.stride(0), v2, v2.stride(0), q_weight, k_weight,
            eps, q_out, k_out, cos_sin_cache, cos_sin_cache.stride(0), kv_cache,
            kv_cache.stride(0), slot_mapping, q_heads, k_heads, head_size,
            cos_sin_cache.shape[-1], 1.0 / k_scale, 1.0 / v_scale, IS_NEOX=is_neox,
            BLOCK_QH=block_qh,
            BLOCK_KH=triton.next_power_of_2(k_heads), BLOCK_D=block_d,
            num_warps=8 if block_qh * block_d >= 8192 else 4, **pdl_options(q.device),
        )
    return q_out.view(q.shape), k_out.view(k.shape)
