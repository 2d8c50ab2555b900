"""Rotary position embedding: a cos/sin cache per rope configuration, applied by the
registry's ``rotary_embedding`` op.

The inverse frequencies follow transformers' ``modeling_rope_utils`` formula for formula
(default, linear, llama3, yarn), and the cache is built in fp32 the way transformers
builds cos/sin (position * inv_freq, then cos/sin, then yarn's attention factor), so the
rotations agree with it to the last bit on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from atom_core.layers.context import get_build_context
from atom_core.ops import resolve_op


def rope_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(base, rope_scaling) from a HF config, old style (rope_theta + rope_scaling) or
    transformers 5 style (rope_parameters). rope_scaling is None for plain RoPE."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = params or dict(getattr(hf_config, "rope_scaling", None) or {})
    base = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(base), None
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return float(base), scaling


def rotary_dim(hf_config: Any, head_dim: int) -> int:
    """How many of each head's ``head_dim`` dims RoPE rotates: ``partial_rotary_factor`` of
    them (in rope_parameters in transformers 5, at the top level before; GLM-4.5 rotates
    half), else a config's own ``rotary_dim`` (GPT-J's, MiniMax-M2's), else all. As
    transformers computes it: ``int(head_dim * factor)``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    if factor is not None:
        return int(head_dim * factor)
    return int(getattr(hf_config, "rotary_dim", None) or head_dim)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3_inv_freq(base: float, dim: int, s: dict[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, max_position: int, s: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    dim_index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dim_index - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_inv_freq(
    rotary_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] fp32 on CPU, attention factor scaling cos/sin)."""
    rope_type = (None if rope_scaling is None
                 else rope_scaling.get("rope_type", rope_scaling.get("type")))
    if rope_type in (None, "default"):
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, rotary_dim) / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, rotary_dim, rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, max_position, rope_scaling)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """``forward(positions, query, key)`` rotates each head's first ``rotary_dim`` dims."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        is_neox: bool = True,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox = is_neox
        inv_freq, attention_factor = rope_inv_freq(rotary_dim, max_position, base, rope_scaling)
        if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn":
            # Serve the extended context even when max_position names the original one.
            original = rope_scaling["original_max_position_embeddings"]
            max_position = max(max_position, int(original * (rope_scaling.get("factor") or 1)))
        # Built on CPU in fp32 (transformers' numerics), then moved; kept fp32 in any model dtype.
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        device = get_build_context().device
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)
        self._op = resolve_op("rotary_embedding", device)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._op(positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, is_neox={self.is_neox}"


_shared: dict[tuple, RotaryEmbedding] = {}


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox: bool = True,
) -> RotaryEmbedding:
    """The rotary module for this configuration, shared by every layer that asks for it
    on the same device (one cos/sin cache per model, not one per layer)."""
    device = torch.device(get_build_context().device)
    key = (head_size, rotary_dim, max_position, base, _freeze(rope_scaling), is_neox, str(device))
    rope = _shared.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling, is_neox)
        _shared[key] = rope
    return rope
