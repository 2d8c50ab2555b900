"""KV-cache write: each new token's K and V into its paged slot; slot -1 (padding) skips."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels_triton.pdl import pdl_options, pdl_wait


@triton.jit
def _write_kv_kernel(k_ptr, k_stride, v_ptr, v_stride, cache_ptr, v_offset, slot_ptr, width,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    k = tl.load(k_ptr + tok * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + tok * v_stride + cols, mask=mask)
    dst = cache_ptr + slot * width + cols
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads * head_dim] (rows may be strided); kv_cache: contiguous
    [2, num_blocks, block_size, kv_heads, head_dim]; writes in place, no host sync."""
    num_tokens = k.shape[0]
    k2, v2 = k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    width = k2.shape[1]
    if num_tokens == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    _write_kv_kernel[(num_tokens, triton.cdiv(width, block))](
        k2, k2.stride(0), v2, v2.stride(0), kv_cache, kv_cache.stride(0), slot_mapping, width,
        BLOCK=block, **pdl_options(k2.device),
    )
