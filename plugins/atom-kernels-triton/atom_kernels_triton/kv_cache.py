"""KV-cache write: each new token's K and V into its paged slot; slot -1 (padding) skips.

An fp8 (float8_e4m3fn) cache (``--kv_cache_dtype fp8``) stores each value as the native
``store_rows`` does: times the fp32 reciprocal of the layer's scale (k_scale, v_scale, or
MLA's kv_scale), saturated to +-448, rounded to nearest even. ``to_cache`` is that
conversion for every Triton kernel that writes a cache. Kernels read such a cache by
converting each loaded tile to their compute dtype and folding the scales into the
softmax scale (K) and the output (V), so no tile is multiplied. The scales are plain
numbers fixed after loading: a captured CUDA graph keeps them as kernel arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from atom_kernels_triton.occupancy import device_limits
from atom_kernels_triton.pdl import pdl_options, pdl_wait

try:  # host-side tensor descriptors: Triton 3.3 on
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

# A layer's cache -> {box rows: (K, V) descriptors}. Weakly keyed, and the descriptors'
# rows share the cache's storage without being views of it (a view holds its base): an
# engine's caches are freed with it, not kept by this module.
_descriptor_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()


def cache_descriptors(kv_cache: torch.Tensor, block_n: int) -> tuple:
    """TMA descriptors of the (contiguous) cache's K and V as [blocks * page, kv_heads *
    head_dim] rows, boxes of ``block_n`` keys of one kv head: an attention kernel's K/V
    tiles, loaded by the copy engine where a page holds whole tiles. Built once per layer's
    cache and box, not on every call."""
    per_box = _descriptor_cache.get(kv_cache)
    if per_box is None:
        per_box = _descriptor_cache[kv_cache] = {}
    found = per_box.get(block_n)
    if found is None:
        _, blocks, page, kv_heads, head_dim = kv_cache.shape
        width = kv_heads * head_dim
        storage = kv_cache.untyped_storage()
        rows = [torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device).set_(
                    storage, kv_cache.storage_offset() + i * kv_cache.stride(0),
                    (blocks * page, width), (width, 1)) for i in (0, 1)]
        found = per_box[block_n] = tuple(TensorDescriptor.from_tensor(r, [block_n, head_dim])
                                         for r in rows)
    return found


def prefers_tma_pages(device: torch.device, head_dim: int) -> bool:
    """Whether 16-bit queries of ``head_dim`` on ``device`` run TMA tiles by default, given
    pages that hold them: a device with TMA, and a power-of-two head dim (a descriptor's box
    is the whole head, unpadded) up to 128 (wider heads take their own smaller tiles)."""
    return (TensorDescriptor is not None and head_dim in (16, 32, 64, 128)
            and device.type == "cuda" and device_limits(device).tma)


def computes_in_f16(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether attention of 16-bit ``q`` over ``kv_cache`` computes on its tiles in fp16: an
    e4m3 tile converts to fp16 exactly, in one instruction a pair (to bf16 in several)."""
    return kv_cache.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _saturate_e4m3(x):
    """fp32 ``x`` clamped to e4m3's +-448 and rounded to nearest even, as float8e4nv.

    The rounding is done on fp32 bits, and the final cast only meets values e4m3 holds
    exactly: Triton's interpreter rounds an inexact float-to-fp8 cast wrongly (it drops the
    mantissa's carry into the exponent), so the CPU tests and the GPU run the same math."""
    a = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # A normal e4m3 value (|a| >= 2^-6) keeps 3 of fp32's 23 mantissa bits: round the low 20
    # to nearest even; a carry moves into the exponent, as it should.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Below 2^-6, e4m3 is subnormal, in steps of 2^-9: the fp32 ulp of 2^14, so adding 2^14
    # rounds |a| to a step (nearest even) and the mantissa bits above 2^14's count the steps.
    steps = (tl.abs(a) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    tiny = (steps.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    # The sign bit copied over, not a negation (compiled as 0 - x, which makes -0.0 +0.0).
    tiny = (tiny | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    q = tl.where(tl.abs(a) < 0.015625, tiny, normal)
    # NaN stays NaN (on GPUs; the interpreter's cast of a NaN gives a finite code).
    return tl.where(x != x, x, q).to(tl.float8e4nv)


@triton.jit
def to_cache(x, cache_ptr, inv_scale):
    """``x`` as the cache at ``cache_ptr`` stores it: a cast, or for an fp8 cache the
    saturated e4m3 value of ``x * inv_scale`` (``store_rows``': ``inv_scale`` is the fp32
    reciprocal of the layer's scale). The branch is resolved at compile time."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        y = _saturate_e4m3(x.to(tl.float32) * inv_scale)
    else:
        y = x.to(cache_ptr.dtype.element_ty)
    return y


@triton.jit
def _write_kv_kernel(k_ptr, k_stride, v_ptr, v_stride, cache_ptr, v_offset, slot_ptr, width,
                     k_inv, v_inv, BLOCK: tl.constexpr, PDL: tl.constexpr):
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
    tl.store(dst, to_cache(k, cache_ptr, k_inv), mask=mask)
    tl.store(dst + v_offset, to_cache(v, cache_ptr, v_inv), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """k, v: [T, kv_heads * head_dim] (rows may be strided); kv_cache: contiguous
    [2, num_blocks, block_size, kv_heads, head_dim], of the inputs' dtype or float8_e4m3fn
    (which stores k / k_scale and v / v_scale); writes in place, no host sync."""
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
        1.0 / k_scale, 1.0 / v_scale, BLOCK=block, **pdl_options(k2.device),
    )
