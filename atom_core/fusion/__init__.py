"""Load-time passes that turn a plain model into the fused decode step.

Model code states the model (norm, qkv, attention, o_proj, add + norm, MLP); after its
weights are loaded, ``fuse_model`` substitutes the core's decoder modules with their
fused forms (``decoder.py``) and prepares the sublayers they drive (``sublayers.py``).
Substitution changes classes only: parameter names, weights and the module tree stay.
A model built from its own block classes runs as written.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core.fusion.decoder import FusedDecoderLayer, FusedDecoderModel
from atom_core.fusion.sublayers import Projected, fuse_sublayer
from atom_core.layers.decoder import DecoderLayer, DecoderModel

__all__ = ["Projected", "fuse_model"]


def fuse_model(model: nn.Module, device: torch.device | str) -> list[str]:
    """Fuse every core ``DecoderModel`` in ``model`` in place; returns one line per stack
    saying what took part (for the start-up log)."""
    report = []
    for name, stack in model.named_modules():
        if type(stack) is not DecoderModel:
            continue
        attn = mlp = 0
        for layer in stack.layers:
            if type(layer) is not DecoderLayer:
                continue
            layer.__class__ = FusedDecoderLayer
            layer.attn_parts = fuse_sublayer(layer.self_attn, device)
            layer.mlp_parts = fuse_sublayer(layer.mlp, device)
            attn += layer.attn_parts is not None
            mlp += layer.mlp_parts is not None
        stack.__class__ = FusedDecoderModel
        report.append(
            f"{name or 'model'}: {len(stack.layers)} layers, fused attention in {attn}, "
            f"fused MLP/MoE in {mlp}"
        )
    return report
