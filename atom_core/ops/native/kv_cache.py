"""Paged KV-cache writes: each new token's K and V (or MLA latent) into its slot; slot -1
(padding) skips.

An fp8 (e4m3) cache (``--kv_cache_dtype fp8``) holds each value divided by its layer's
per-tensor scale, saturated to e4m3's range: ``e4m3(x * fp32(1 / scale))``, the division
done as a multiplication by the fp32 reciprocal, as the kernels do it, so that every
implementation stores the same bytes. Reading it back is ``stored * scale``
(``dequantize``). Scales are 1.0 unless the checkpoint or ``--kv-cache-scales`` gives
others (atom_core/layers/attention/kv_scales.py); a cache of any other dtype ignores them.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """k, v: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads,
    head_dim]. Written in place (the cache is never reallocated)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    store_rows(flat[0], slot_mapping, k, k_scale)
    store_rows(flat[1], slot_mapping, v, v_scale)


def store_rows(
    flat: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor, scale: float = 1.0
) -> None:
    """``flat[slot_mapping[i]] = values[i]`` in ``flat``'s dtype, skipping slot -1; an fp8
    ``flat`` gets ``values / scale``, saturated."""
    if slot_mapping.device.type != "cpu" or bool((slot_mapping < 0).any()):
        # Padding tokens (slot -1) repeat the first real token's write: duplicate writes
        # of identical values, so nothing is clobbered and the GPU needs no host sync.
        valid = slot_mapping >= 0
        first = valid.int().argmax()
        src = torch.where(valid, torch.arange(len(slot_mapping), device=values.device), first)
        slot_mapping, values = slot_mapping[src].clamp(min=0), values[src]
    if flat.dtype == FP8_KV_DTYPE:
        scaled = values.float() * (1.0 / scale)  # torch rounds the reciprocal to fp32
        quantized = scaled.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)
        # torch has no fp8 index_copy_: the bytes go through a uint8 view.
        flat.view(torch.uint8).index_copy_(0, slot_mapping, quantized.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping, values.to(flat.dtype))


def dequantize(cached: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values as attention reads them: an fp8 cache's in fp32, times its scale; any
    other cache's as they are."""
    if cached.dtype != FP8_KV_DTYPE:
        return cached
    return cached.float() * scale
