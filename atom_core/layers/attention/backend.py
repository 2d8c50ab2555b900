"""The contract of a paged attention backend (registered via register_attention_backends)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.ops import resolve_op


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

    ``forward_qk_norm_rope`` takes q, k and v as the qkv projection produced them, with
    ``QKNormRope``'s norms and RoPE still to apply (Qwen3's attention input). Every backend
    has it: the default runs the input's ops, then ``forward``; a backend whose decode
    kernels can fold the whole attention input into their own launch overrides it.
    """

    accepts_written_cache: bool = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self._ops: dict[tuple[str, str], Callable[..., Any]] = {}  # see _op

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
        """The input's ops on q's device, then ``forward``: norms, RoPE and the K/V cache
        write in one op (``qk_norm_rope_cache_write``) where this backend accepts a written
        cache, else the ``rms_norm`` op per head and the ``rotary_embedding`` op."""
        if self.accepts_written_cache:
            q, k = self._op("qk_norm_rope_cache_write", q.device)(
                q, k, v, spec.q_weight, spec.k_weight, spec.eps, spec.positions, spec.cos_sin_cache,
                kv_cache, meta.slot_mapping, spec.is_neox,
            )
            return self.forward(q, k, v, kv_cache, meta, cache_written=True)
        norm, d = self._op("rms_norm", q.device), self.head_dim
        # Per-head norms: each token's heads as rows of head_dim.
        q = norm(q.reshape(-1, d), spec.q_weight, spec.eps).view(q.shape)
        k = norm(k.reshape(-1, d), spec.k_weight, spec.eps).view(k.shape)
        q, k = self._op("rotary_embedding", q.device)(spec.positions, q, k, d, spec.cos_sin_cache, spec.is_neox)
        return self.forward(q, k, v, kv_cache, meta)

    def _op(self, name: str, device: torch.device) -> Callable[..., Any]:
        """The registry's op for device, resolved once per backend (a layer's eager step
        would otherwise filter and sort the registry three times)."""
        key = (name, device.type)
        if key not in self._ops:
            self._ops[key] = resolve_op(name, device)
        return self._ops[key]
