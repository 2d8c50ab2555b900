"""The contract of a paged attention backend (registered via register_attention_backends)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from atom_core.layers.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class QKNormRope:
    """Qwen3's attention input: per-head RMSNorm of q and k (weights ``[head_dim]``), then
    RoPE at ``positions`` from ``cos_sin_cache`` (``[max_position, rot_dim]``, cos then sin)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox: bool


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

    A backend with ``accepts_qk_norm_rope`` also takes ``forward_qk_norm_rope``: q, k and v
    as the qkv projection produced them, with the norms and RoPE still to apply (a model
    asks for it only where its attention input is exactly ``QKNormRope``). Decode kernels
    can then fold the whole attention input into attention's own launch.
    """

    accepts_written_cache: bool = False
    accepts_qk_norm_rope: bool = False

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

    def forward_qk_norm_rope(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim], before norm and RoPE
        k: torch.Tensor,  # [T, num_kv_heads * head_dim], before norm and RoPE
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: QKNormRope,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        raise NotImplementedError(f"{type(self).__name__} does not take forward_qk_norm_rope")
