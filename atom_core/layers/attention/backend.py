"""The contract of a paged attention backend (registered via register_attention_backends)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from atom_core.layers.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """One layer's attention over a paged cache.

    The cache of one layer is a tensor of ``kv_cache_shape(...)``; for MHA/GQA it is
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V). ``forward`` writes
    the new tokens' K/V into the cache at ``meta.slot_mapping`` and returns attention of
    the new queries over each sequence's whole context, causal within the sequence.

    A backend with ``accepts_written_cache`` also takes ``forward(..., cache_written=True)``:
    a fused op (e.g. ``qk_norm_rope_cache_write``) has already stored K/V at the slots,
    so the backend skips its own write. Only backends over the dense cache layout above
    can accept it; the default is False, and then the keyword is never passed.
    """

    accepts_written_cache: bool = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,  # [T, num_kv_heads * head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        cache_written: bool = False,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...
