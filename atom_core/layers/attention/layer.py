"""The Attention module models call; the paged backend it delegates to comes from the registry."""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
from torch import nn

from atom_core.errors import UnsupportedError
from atom_core.layers.attention.backend import AttentionBackend, AttentionInput
from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import get_build_context, get_forward_context
from atom_core.layers.norm import RMSNorm
from atom_core.layers.rotary import RotaryEmbedding
from atom_core.ops import device_kind
from atom_core.plugins import get_registries

logger = logging.getLogger(__name__)


class _InputModules(NamedTuple):
    """The modules of a layer's attention input. Held in a tuple, not as submodules: they
    belong to the model's attention block (checkpoint names such as
    ``self_attn.q_norm.weight``); this layer only reads them."""

    rope: RotaryEmbedding
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None


def _lacks(backend: type, sinks: torch.Tensor | None, sliding_window: int | None) -> str:
    """What of the layer's sinks and sliding window the backend class does not implement."""
    lacks = [what for what, needed, has in (
        ("attention sinks", sinks is not None, backend.supports_sinks),
        ("sliding window", sliding_window is not None, backend.supports_sliding_window),
    ) if needed and not has]
    return " or ".join(lacks)


@functools.cache
def _say_native_instead(backend: str, lacks: str) -> None:
    """Once per process and reason, not once per layer."""
    logger.info("attention backend %s has no %s: those layers use native", backend, lacks)


class Attention(nn.Module):
    """One layer's attention over its paged K/V cache.

    The backend is chosen at construction: the highest-priority "mha" backend for the
    build context's device, or the one ``BuildContext.attention_backend`` names. The model
    runner allocates this layer's cache and assigns it::

        layer.kv_cache = torch.empty(layer.kv_cache_shape(num_blocks, block_size),
                                     dtype=kv_dtype, device=device)

    (contiguous; every layer its own tensor) and runs the model inside
    ``forward_context(meta)``; ``forward`` reads that metadata.

    Given ``rope`` (and optionally per-head ``q_norm`` / ``k_norm``), the layer takes q and
    k as the qkv projection made them, with ``positions``: the backend applies the norms,
    RoPE and the cache write, in one kernel where it can (``AttentionBackend.forward_input``).

    ``sinks`` (the model's per-head sink logits, [num_heads]) and ``sliding_window`` are
    handed to the backend (``AttentionBackend``); where the registry's choice lacks one
    the layer needs, the layer takes the native backend, and says so.
    """

    kind = "mha"

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        rope: RotaryEmbedding | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if (q_norm is None) != (k_norm is None) or (q_norm is not None and rope is None):
            raise ValueError("Attention takes q_norm and k_norm together, and only with rope")
        if rope is not None and rope.head_size != head_dim:
            raise ValueError(f"rope of head size {rope.head_size} for heads of {head_dim}")
        self._input = _InputModules(rope, q_norm, k_norm) if rope is not None else None
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.scale = scale
        ctx = get_build_context()
        info = get_registries().attention_backends.resolve(
            self.kind, device_kind(ctx.device), ctx.attention_backend
        )
        lacks = _lacks(info.cls, sinks, sliding_window)
        if lacks and ctx.attention_backend is None:
            _say_native_instead(info.name, lacks)
            info = get_registries().attention_backends.resolve(
                self.kind, device_kind(ctx.device), "native")
        elif lacks:
            raise UnsupportedError(f"attention backend {info.name!r} has no {lacks}")
        self.backend_name = info.name
        self.backend: AttentionBackend = info.cls(num_heads, head_dim, self.num_kv_heads, scale)
        self.backend.sinks, self.backend.sliding_window = sinks, sliding_window
        # Not a buffer: the runner owns the cache's memory and its lifetime.
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales_from_checkpoint = False  # see kv_scales.py

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.backend.kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def kv_scales(self) -> tuple[float, float]:
        """(K scale, V scale) of an fp8 cache: it stores ``x / scale`` (kv_scales.py)."""
        return self.backend.k_scale, self.backend.v_scale

    def set_kv_scales(self, k: float | None = None, v: float | None = None) -> None:
        """Set the fp8 cache's K and/or V scale (None keeps one); before graphs are captured."""
        if k is not None:
            self.backend.k_scale = k
        if v is not None:
            self.backend.v_scale = v

    @property
    def accepts_written_cache(self) -> bool:
        """True when the backend can skip its K/V write (``forward(..., cache_written=True)``)
        because a fused op such as ``qk_norm_rope_cache_write`` stored them in ``kv_cache``."""
        return self.backend.accepts_written_cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the new tokens' q over their sequences' cached and new K/V. Built
        with ``rope``, the layer takes ``positions`` and q/k before norms and RoPE."""
        meta = self._metadata()
        if self._input is None:
            return self.backend.forward(q, k, v, self.kv_cache, meta)
        if positions is None:
            raise ValueError("Attention built with rope needs the tokens' positions")
        rope, q_norm, k_norm = self._input
        inp = AttentionInput(
            positions, rope.cos_sin_cache, rope.is_neox,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 1e-6,
        )
        return self.backend.forward_input(q, k, v, self.kv_cache, meta, inp)

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
