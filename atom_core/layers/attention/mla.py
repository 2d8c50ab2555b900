"""Multi-head latent attention (DeepSeek-V2/V3): the layer models call and the contract of
its paged backends (registered via register_attention_backends with kind "mla").

MLA caches, per token, one latent vector instead of per-head K/V: ``kv_c`` (the
kv_a_layernorm'd compression, ``kv_lora_rank`` values) followed by ``k_pe`` (the rotated
key part shared by all heads, ``qk_rope_head_dim`` values). Per head, keys and values are
up-projections of ``kv_c`` by ``kv_b_proj`` (W_UK rows give ``k_nope``, W_UV rows give
``v``), with ``k_pe`` appended to every head's key. A backend may attend either way:

- non-absorbed: expand the context's latents through ``kv_b_proj`` into full K/V (cheap
  when the new tokens are most of the context: prefill);
- absorbed: fold W_UK into the query (``q_nope @ W_UK`` -> a latent-space query), attend
  over the latents themselves, then apply W_UV to the latent output (cheap for decode:
  the context is never expanded).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import get_build_context, get_forward_context
from atom_core.ops import device_kind
from atom_core.plugins import get_registries


class MLABackend(ABC):
    """One layer's latent attention over a ``[num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]`` cache. ``forward`` writes the new tokens' latents at
    ``meta.slot_mapping`` and returns each new query's attention over its sequence's whole
    context (causal within the sequence), as ``[T, num_heads * v_head_dim]``.
    ``fp8_kv_cache``: as ``AttentionBackend``'s, with one scale, ``kv_scale``, for the
    whole latent row (MLA caches one vector per token)."""

    fp8_kv_cache: bool = False
    kv_scale: float = 1.0  # fixed after loading, as AttentionBackend's k_scale

    def preferred_block_size(self, device: torch.device) -> int | None:
        """As ``AttentionBackend.preferred_block_size``."""
        return None

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
    ) -> None:
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, kv_lora_rank: int, qk_rope_head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)

    @abstractmethod
    def forward(
        self,
        q_nope: torch.Tensor,  # [T, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [T, num_heads, qk_rope_head_dim], rotated
        kv_c: torch.Tensor,  # [T, kv_lora_rank], normalised
        k_pe: torch.Tensor,  # [T, qk_rope_head_dim], rotated
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * v_head_dim]
        ...


class MLAAttention(nn.Module):
    """One layer's MLA over its paged latent cache; the same runner contract as
    ``Attention`` (``kv_cache_shape``, ``backend_name``, ``kv_cache``).

    The backend is the highest-priority "mla" backend for the build context's device, or
    the one ``BuildContext.attention_backend`` names when that is an MLA backend (a forced
    MHA backend applies to a model's MHA layers, not to these).
    ``forward(q_nope, q_pe, kv_c, k_pe, kv_b_weight)`` takes ``kv_b_proj``'s weight per call
    so the parameter has one owner and one checkpoint name.
    """

    kind = "mla"

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        ctx = get_build_context()
        registry = get_registries().attention_backends
        forced = ctx.attention_backend
        if forced in registry.backends and registry.backends[forced].kind != self.kind:
            forced = None
        info = registry.resolve(self.kind, device_kind(ctx.device), forced)
        self.backend_name = info.name
        self.backend: MLABackend = info.cls(
            num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, scale
        )
        # Not a buffer: the runner owns the cache's memory and its lifetime.
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales_from_checkpoint = False  # see kv_scales.py

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.backend.kv_cache_shape(
            num_blocks, block_size, self.kv_lora_rank, self.qk_rope_head_dim
        )

    @property
    def kv_scales(self) -> tuple[float]:
        """The one scale of an fp8 latent cache: it stores ``x / scale`` (kv_scales.py)."""
        return (self.backend.kv_scale,)

    def set_kv_scales(self, k: float | None = None, v: float | None = None) -> None:
        """The latent cache's scale is the K scale, as vLLM reads MLA checkpoints: the whole
        cached row is key (``kv_c`` also the value's source), so a V scale is not applied."""
        if k is not None:
            self.backend.kv_scale = k

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        try:
            meta = get_forward_context()
        except RuntimeError:
            raise RuntimeError(
                "MLAAttention.forward needs attention metadata: run the model inside "
                "atom_core.layers.context.forward_context(meta)"
            ) from None
        if self.kv_cache is None:
            raise RuntimeError(
                "MLAAttention.kv_cache is not set: the model runner must assign each layer of "
                "model.attention_layers() a tensor of layer.kv_cache_shape(num_blocks, block_size)"
            )
        return self.backend.forward(q_nope, q_pe, kv_c, k_pe, kv_b_weight, self.kv_cache, meta)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, "
            f"v={self.v_head_dim}, backend={self.backend_name}"
        )
