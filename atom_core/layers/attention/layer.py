"""The Attention module models call; the paged backend it delegates to comes from the registry."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.layers.attention.backend import AttentionBackend, QKNormRope
from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import get_build_context, get_forward_context
from atom_core.ops import device_kind
from atom_core.plugins import get_registries


class Attention(nn.Module):
    """One layer's attention over its paged K/V cache.

    The backend is chosen at construction: the highest-priority "mha" backend for the
    build context's device, or the one ``BuildContext.attention_backend`` names. The model
    runner allocates this layer's cache and assigns it::

        layer.kv_cache = torch.empty(layer.kv_cache_shape(num_blocks, block_size),
                                     dtype=kv_dtype, device=device)

    (contiguous; every layer its own tensor) and runs the model inside
    ``forward_context(meta)``; ``forward`` reads that metadata.
    """

    kind = "mha"

    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.scale = scale
        ctx = get_build_context()
        info = get_registries().attention_backends.resolve(
            self.kind, device_kind(ctx.device), ctx.attention_backend
        )
        self.backend_name = info.name
        self.backend: AttentionBackend = info.cls(num_heads, head_dim, self.num_kv_heads, scale)
        # Not a buffer: the runner owns the cache's memory and its lifetime.
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.backend.kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def accepts_written_cache(self) -> bool:
        """True when the backend can skip its K/V write (``forward(..., cache_written=True)``)
        because a fused op such as ``qk_norm_rope_cache_write`` stored them in ``kv_cache``."""
        return self.backend.accepts_written_cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_written: bool = False
    ) -> torch.Tensor:
        meta = self._metadata()
        if cache_written:
            if not self.accepts_written_cache:
                raise RuntimeError(
                    f"attention backend {self.backend_name!r} writes its own K/V cache; "
                    "call forward(q, k, v) without cache_written"
                )
            return self.backend.forward(q, k, v, self.kv_cache, meta, cache_written=True)
        # Without the keyword, so backends predating it keep working.
        return self.backend.forward(q, k, v, self.kv_cache, meta)

    def forward_qk_norm_rope(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: QKNormRope
    ) -> torch.Tensor:
        """Attention of q/k/v straight from the projection: the backend norms and rotates q
        and k (``spec``) and stores the new K/V, in its own kernels where it can."""
        meta = self._metadata()
        return self.backend.forward_qk_norm_rope(q, k, v, self.kv_cache, meta, spec)

    def _metadata(self) -> AttentionMetadata:
        try:
            meta = get_forward_context()
        except RuntimeError:
            raise RuntimeError(
                "Attention.forward needs attention metadata: run the model inside "
                "atom_core.layers.context.forward_context(meta)"
            ) from None
        if self.kv_cache is None:
            raise RuntimeError(
                "Attention.kv_cache is not set: the model runner must assign each layer of "
                "model.attention_layers() a tensor of layer.kv_cache_shape(num_blocks, block_size)"
            )
        return meta

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend_name}"
        )
