"""The fused pre-norm block and stack: ``DecoderLayer`` / ``DecoderModel`` with each norm
run together with the op before or after it.

At decode sizes a norm between two sublayers costs its round trips, not its arithmetic.
So the block runs a norm and the projection that reads it as one op
(``RMSNorm.project``, the ``rms_norm_linear`` op), and asks the op that produces a
sublayer's output to finish the next norm's residual add (``AddNorm``): that op may
return a ``DeferredNorm``, which the next projection reads directly, and the norm's own
kernel drops out (``atom_core.ops.deferred_norm``). Where both sublayers of a block take
part, the attention finishes the post-attention norm; the MLP finishes the next layer's
input norm where that layer's attention takes part too.

The results are those of the plain modules up to where the rounding happens (see
``atom_core.ops.deferred_norm``).
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core.fusion.sublayers import Parts, Projected
from atom_core.layers.decoder import DecoderLayer, DecoderModel, residual_stream
from atom_core.layers.norm import RMSNorm
from atom_core.ops.deferred_norm import AddNorm, DeferredNorm


class FusedDecoderLayer(DecoderLayer):
    """``DecoderLayer`` driving its sublayers through their ``Parts`` (set by the pass)."""

    attn_parts: Parts | None = None
    mlp_parts: Parts | None = None

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor | DeferredNorm,
        residual: torch.Tensor | None, next_layer: DecoderLayer | None = None,
    ) -> tuple[torch.Tensor | DeferredNorm, torch.Tensor]:
        """``hidden_states`` is a ``DeferredNorm`` (its ``summed`` the residual) where the
        layer before finished this layer's input norm; given ``next_layer`` whose attention
        takes part, this layer's MLP may finish that layer's input norm."""
        attn, mlp = self.attn_parts, self.mlp_parts
        finish = self.post_attention_layernorm if attn and mlp else None
        hidden_states, residual = _pre_norm(
            self.input_layernorm, self.self_attn, attn, hidden_states, residual, finish, mlp,
            positions,
        )
        nxt = getattr(next_layer, "attn_parts", None)
        finish = next_layer.input_layernorm if nxt and mlp else None
        return _pre_norm(
            self.post_attention_layernorm, self.mlp, mlp, hidden_states, residual, finish, nxt
        )


def _pre_norm(
    norm: RMSNorm, sublayer: nn.Module, parts: Parts | None, x: torch.Tensor | DeferredNorm,
    residual: torch.Tensor | None, finish: RMSNorm | None, reader: Parts | None,
    *args: torch.Tensor,
) -> tuple[torch.Tensor | DeferredNorm, torch.Tensor]:
    """(sublayer(*args, norm(x + residual)), x + residual), residual None meaning 0; x a
    ``DeferredNorm`` already holds both. With ``finish`` the sublayer's last op is asked to
    finish that norm for ``reader`` (its output may then come as a ``DeferredNorm``)."""
    proj = parts.input_proj if parts is not None else None
    if isinstance(x, DeferredNorm):
        y, residual = (proj(x) if proj is not None else x), x.summed
    elif proj is not None:
        y, residual = norm.project(x, residual, proj)
    else:
        y, residual = (norm(x), x) if residual is None else norm(x, residual)
    if finish is not None:
        # The op declines (returns its plain output) where the reader would norm anyway.
        weight = reader.input_proj.op_weight if reader and reader.input_proj is not None else None
        parts.finisher.pending = AddNorm(residual, finish.weight, finish.eps, weight)
    out = sublayer(*args, Projected(y) if proj is not None else y)
    if parts is not None and parts.finisher.pending is not None:
        raise RuntimeError(
            f"{type(sublayer).__name__} did not return its last op's output as it is; "
            "see atom_core.fusion.sublayers for the shapes the fusion takes"
        )
    return out, residual


class FusedDecoderModel(DecoderModel):
    """``DecoderModel`` handing each layer the next, so its MLP may finish that layer's
    input norm."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        layers = list(self.layers)
        aux, kept = self.aux_hidden_layers, {}
        for i, (layer, after) in enumerate(zip(layers, layers[1:] + [None])):
            if aux and i in aux:
                kept[i] = residual_stream(hidden_states, residual)
            # The last layer's output goes to the final norm, which is not deferred: the LM
            # head reads only the sampled rows, and cuBLAS at that.
            hidden_states, residual = layer(positions, hidden_states, residual, after)
        if aux:
            self.aux_hidden_states = [kept[i] for i in aux]
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
