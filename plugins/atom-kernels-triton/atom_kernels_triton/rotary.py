"""Rotary embedding of query and key in one launch: one program per token, all its heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels_triton.pdl import pdl_options, pdl_wait


@triton.jit
def rope_pairs(d, rot_dim, IS_NEOX: tl.constexpr):
    """(first, partner, freq) of head element d: out[d] = x[d] * cos[freq] + sign * x[partner]
    * sin[freq], sign -1 for the first of a pair; that is exactly (x1 cos - x2 sin, x2 cos +
    x1 sin) of the native op. NeoX pairs d with d + rot_dim / 2, GPT-J with its neighbour."""
    half = rot_dim // 2
    if IS_NEOX:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        freq = tl.where(first, d, d - half)
    else:
        first = (d % 2) == 0
        partner = tl.where(first, d + 1, d - 1)
        freq = d // 2
    return first, partner, freq


@triton.jit
def _rotate_heads(src, src_stride, head_stride, dst, cs_ptr, tok, heads, head_size, rot_dim,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < head_size)
    base = src + tok * src_stride + h[:, None] * head_stride
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    half = rot_dim // 2
    first, partner, freq = rope_pairs(d, rot_dim, IS_NEOX)
    rot = d < rot_dim
    xp = tl.load(base + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    cos = tl.load(cs_ptr + freq, mask=rot, other=1.0)
    sin = tl.load(cs_ptr + half + freq, mask=rot, other=0.0)
    sign = tl.where(first, -1.0, 1.0)
    y = tl.where(rot[None, :], x * cos[None, :] + (sign * sin)[None, :] * xp, x)
    tl.store(dst + tok * heads * head_size + h[:, None] * head_size + d[None, :],
             y.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, q_stride, q_head_stride, k_ptr, k_stride, k_head_stride, q_out,
                   k_out, cs_ptr, cs_stride,
                   q_heads, k_heads, head_size, rot_dim, IS_NEOX: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cs = cs_ptr + pos * cs_stride
    _rotate_heads(q_ptr, q_stride, q_head_stride, q_out, cs, tok, q_heads, head_size, rot_dim,
                  IS_NEOX, BLOCK_QH, BLOCK_D)
    _rotate_heads(k_ptr, k_stride, k_head_stride, k_out, cs, tok, k_heads, head_size, rot_dim,
                  IS_NEOX, BLOCK_KH, BLOCK_D)


def _by_head(x: torch.Tensor, head_size: int) -> tuple[torch.Tensor, int, int, int]:
    """(x, row stride, head stride, heads) for a kernel that reads each head's elements
    contiguously. A [T, heads, head_size] view whose heads are strided (DeepSeek's q_pe, a
    slice of each head of q) is read in place; anything else as rows of heads * head_size,
    copied only where that is not a view."""
    if x.dim() == 3 and x.shape[2] == head_size and x.stride(2) == 1:
        return x, x.stride(0), x.stride(1), x.shape[1]
    x2 = x.reshape(x.shape[0], -1)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.stride(0), head_size, x2.shape[1] // head_size


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the native op: new rotated tensors of the inputs' shapes
    ([T, heads * head_size] or [T, heads, head_size]), contiguous."""
    q2, q_stride, q_head_stride, q_heads = _by_head(query, head_size)
    k2, k_stride, k_head_stride, k_heads = _by_head(key, head_size)
    num_tokens = query.shape[0]
    q_out = torch.empty((num_tokens, q_heads * head_size), dtype=query.dtype, device=query.device)
    k_out = torch.empty((num_tokens, k_heads * head_size), dtype=key.dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q2, q_stride, q_head_stride, k2, k_stride, k_head_stride, q_out, k_out,
            cos_sin_cache,
            cos_sin_cache.stride(0), q_heads, k_heads, head_size, cos_sin_cache.shape[-1],
            IS_NEOX=is_neox, BLOCK_QH=triton.next_power_of_2(q_heads),
            BLOCK_KH=triton.next_power_of_2(k_heads), BLOCK_D=triton.next_power_of_2(head_size),
            **pdl_options(query.device),
        )
    return q_out.view(query.shape), k_out.view(key.shape)
