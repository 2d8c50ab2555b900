"""Paged KV-cache writes: each new token's K and V (or MLA latent) into its slot; slot -1
(padding) skips. An fp8 (e4m3) cache stores values saturated to its range, with a scale of
one (``--kv_cache_dtype fp8``)."""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads,
    head_dim]. Written in place (the cache is never reallocated)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    store_rows(flat[0], slot_mapping, k)
    store_rows(flat[1], slot_mapping, v)


def store_rows(flat: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[slot_mapping[i]] = values[i]`` in ``flat``'s dtype, skipping slot -1."""
    if slot_mapping.device.type != "cpu" or bool((slot_mapping < 0).any()):
        # Padding tokens (slot -1) repeat the first real token's write: duplicate writes
        # of identical values, so nothing is clobbered and the GPU needs no host sync.
        valid = slot_mapping >= 0
        first = valid.int().argmax()
        src = torch.where(valid, torch.arange(len(slot_mapping), device=values.device), first)
        slot_mapping, values = slot_mapping[src].clamp(min=0), values[src]
    if flat.dtype == FP8_KV_DTYPE:
        # torch has no fp8 index_copy_: the bytes go through a uint8 view.
        quantized = values.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)
        flat.view(torch.uint8).index_copy_(0, slot_mapping, quantized.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping, values.to(flat.dtype))
