"""Per-layer scales of an fp8 KV cache (``--kv_cache_dtype fp8``): where they come from.

An fp8 (e4m3) cache stores ``x / scale``, saturated to +-448, and attention reads
``stored * scale`` (ops/native/kv_cache.py): one scale for a layer's K and one for its V,
or for MLA one for its latent cache. A layer takes them from its checkpoint where it has
them, else from ``--kv-cache-scales``, else keeps 1.0. They are plain numbers, fixed once
the weights are loaded: kernels take them as arguments, and a CUDA graph captured after
loading keeps them. A cache of the model's dtype ignores them, as vLLM does; so does a
checkpoint's scale the cache does not use (MLA's V scale).

Checkpoint names, as vLLM reads them (its ``maybe_remap_kv_scale_name``), each a single
number (shape [] or [1]) per layer:
- ``<attn>.k_scale`` / ``<attn>.v_scale`` on the attention block (``self_attn``:
  compressed-tensors / llm-compressor) or on its attention module (``self_attn.attn``,
  vLLM's own);
- ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` (NVIDIA ModelOpt, MLA models too)
  and ``<attn>.qkv_proj.k_scale`` / ``v_scale``;
- ``<attn>.kv_scale``: the older single scale of both.
MLA's one latent cache takes the K scale, as in vLLM. DeepSeek's own FP8 checkpoints
(V3, R1: block-scaled weights, dynamic activations) ship no KV-cache scales.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from atom_core.errors import ConfigError
from atom_core.layers.attention.layer import Attention
from atom_core.layers.attention.mla import MLAAttention

KV_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")
# Projections a checkpoint may hang a scale on, one level below the attention block.
_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj")

KVLayer = Attention | MLAAttention


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """The one finite, positive number a KV-cache scale tensor holds; anything else is a
    ConfigError naming the tensor."""
    if tensor.numel() != 1:
        raise ConfigError(f"checkpoint tensor {name!r}: a KV-cache scale is one number per "
                          f"layer, this one has shape {list(tensor.shape)}")
    value = float(tensor.float())
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"checkpoint tensor {name!r}: a KV-cache scale must be finite and "
                          f"positive, got {value}")
    return value


class KVScaleLoader:
    """Sets the checkpoint's KV-cache scales on ``model``'s attention layers, by name."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._layers: dict[str, KVLayer] | None = None  # by module name, found on first use

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Set the scale ``name`` names; False when ``name`` is no KV-cache scale's."""
        owner, _, kind = name.rpartition(".")
        if kind not in KV_SCALE_NAMES:
            return False
        layer = self._layer(owner, name)
        value = scale_value(name, tensor)
        if kind == "k_scale":
            layer.set_kv_scales(k=value)
        elif kind == "v_scale":
            layer.set_kv_scales(v=value)
        else:
            layer.set_kv_scales(value, value)
        layer.kv_scales_from_checkpoint = True
        return True

    def _layer(self, owner: str, name: str) -> KVLayer:
        if self._layers is None:
            self._layers = {n: m for n, m in self.model.named_modules()
                            if isinstance(m, (Attention, MLAAttention))}
        parent, _, last = owner.rpartition(".")
        if last in _PROJECTIONS:
            owner = parent
        if owner in self._layers:
            return self._layers[owner]
        # The attention block (``self_attn``) holding one attention module.
        children = [m for n, m in self._layers.items() if n.rpartition(".")[0] == owner]
        if len(children) != 1:
            raise KeyError(f"checkpoint tensor {name!r} is a KV-cache scale, and no attention "
                           "layer of the model has that name")
        return children[0]


def resolve_kv_scales(
    layers: Sequence[KVLayer], kv_cache_dtype: str, fallback: Sequence[float] | None
) -> str | None:
    """Once the weights are loaded: with an fp8 cache, layers whose checkpoint gave no
    scales take ``fallback`` (``--kv-cache-scales``: K, or K then V) where given. Returns
    the line to log about it, None where there is nothing to say."""
    from_checkpoint = [layer for layer in layers if layer.kv_scales_from_checkpoint]
    if kv_cache_dtype != "fp8":
        if not from_checkpoint:
            return None
        return (f"the checkpoint's KV-cache scales ({len(from_checkpoint)} layers) are not "
                f"used: the KV cache is {kv_cache_dtype}, not fp8")
    others = [layer for layer in layers if not layer.kv_scales_from_checkpoint]
    if fallback:
        for layer in others:
            layer.set_kv_scales(fallback[0], fallback[-1])
    parts = []
    if from_checkpoint:
        values = [s for layer in from_checkpoint for s in layer.kv_scales]
        parts.append(f"{len(from_checkpoint)} layers from the checkpoint "
                     f"({min(values):.4g} to {max(values):.4g})")
    if others:
        given = "--kv-cache-scales " + " ".join(f"{s:g}" for s in fallback) if fallback else (
            "1.0 (none in the checkpoint)")
        parts.append(f"{len(others)} layers {given}")
    return "fp8 KV cache scales: " + ", ".join(parts)
