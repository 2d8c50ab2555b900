"""Paged KV-cache write: each new token's K and V into its slot; slot -1 (padding) skips."""

from __future__ import annotations

import torch


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads,
    head_dim]. Written in place (the cache is never reallocated)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    if slot_mapping.device.type != "cpu" or bool((slot_mapping < 0).any()):
        # Padding tokens (slot -1) repeat the first real token's write: duplicate writes
        # of identical values, so nothing is clobbered and the GPU needs no host sync.
        valid = slot_mapping >= 0
        first = valid.int().argmax()
        src = torch.where(valid, torch.arange(len(slot_mapping), device=k.device), first)
        slot_mapping, k, v = slot_mapping[src].clamp(min=0), k[src], v[src]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
