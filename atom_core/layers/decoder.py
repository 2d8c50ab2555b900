"""The parts every decoder-only model shares: the pre-norm block, the stack, the LM head.

A model plugin writes its attention and MLP, and builds on these. Module names follow
transformers' (``model.embed_tokens``, ``model.layers.N.input_layernorm``, ``lm_head``),
so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from atom_core.layers.context import get_build_context
from atom_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from atom_core.layers.model_api import load_hf_weights
from atom_core.layers.norm import RMSNorm
from atom_core.ops import resolve_op
from atom_core.ops.deferred_norm import AddNorm, DeferredNorm


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up fused in one GEMM, and the
    activation fused into the down projection (the ``silu_and_mul_linear`` op, one kernel
    fewer a layer at decode); ``down_proj`` holds the weights and is not called itself.
    ``input_proj`` / ``forward_projected``: see ``DecoderLayer``."""

    defers_norm = True

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self._silu_and_mul_linear = resolve_op("silu_and_mul_linear", get_build_context().device)

    @property
    def input_proj(self) -> nn.Module:
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(self.gate_up_proj(x))

    def forward_projected(self, gate_up: torch.Tensor, add_norm: AddNorm | None = None) -> torch.Tensor | DeferredNorm:
        down = self.down_proj
        # As RowParallelLinear.forward: with TP > 1 only rank 0 adds the bias.
        bias = down.bias if down.tp_rank == 0 else None
        return self._silu_and_mul_linear(gate_up, down.weight, bias, add_norm=add_norm)


class DecoderLayer(nn.Module):
    """Pre-norm block: norm -> self_attn -> norm -> mlp, with each residual add fused into
    the following norm (``fused_add_rms_norm``). ``self_attn(positions, x)`` and ``mlp(x)``
    are the model's own.

    A sublayer whose first step is a column-parallel projection of its input may say so:
    ``input_proj`` is that layer and ``forward_projected`` (``(positions, y)`` for
    attention, ``(y)`` for the MLP) the rest of its forward. The block then runs its norm
    and that projection as one op (``RMSNorm.project``: one kernel at decode sizes, and a
    kernel fewer each time). Sublayers without them (MoE blocks, whose normed input goes to
    a router and the experts) get the normed input as before.

    A sublayer with ``defers_norm`` True takes a ``DeferredNorm`` as its normed input and an
    ``add_norm`` keyword (``AddNorm``) on its forward (``forward_projected`` where it has an
    input projection), which it hands to its last op: that op may then finish the next
    norm's residual add and return a ``DeferredNorm`` (``atom_core.ops.deferred_norm``), and
    the next norm's own kernel drops out. Where both sublayers defer, the attention finishes
    the post-attention norm; the MLP finishes the next layer's input norm, where
    ``DecoderModel`` passes that layer and its attention defers too.
    """

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor | DeferredNorm, residual: torch.Tensor | None,
        next_layer: DecoderLayer | None = None,
    ) -> tuple[torch.Tensor | DeferredNorm, torch.Tensor]:
        """``hidden_states`` is a ``DeferredNorm`` (its ``summed`` the residual) where the layer
        before finished this layer's input norm; given ``next_layer`` whose attention defers,
        this layer's MLP may finish that layer's input norm."""
        both = defers_norm(self.self_attn) and defers_norm(self.mlp)
        hidden_states, residual = _pre_norm(self.input_layernorm, self.self_attn, hidden_states, residual,
                                            self.post_attention_layernorm if both else None, self.mlp, positions)
        nxt = next_layer if next_layer is not None and defers_norm(next_layer.self_attn) else None
        finish, reader = (nxt.input_layernorm, nxt.self_attn) if nxt is not None and defers_norm(self.mlp) \
            else (None, None)
        return _pre_norm(self.post_attention_layernorm, self.mlp, hidden_states, residual, finish, reader)


def defers_norm(sublayer: nn.Module) -> bool:
    return getattr(sublayer, "defers_norm", False)


def _reader(sublayer: nn.Module | None) -> torch.Tensor | None:
    """The weight of the projection that reads a deferring sublayer's normed input, or None
    (its readers are not ``linear`` ops: the MoE's router and experts)."""
    proj = getattr(sublayer, "input_proj", None)
    return proj.weight if proj is not None else None


def _pre_norm(
    norm: RMSNorm, sublayer: nn.Module, x: torch.Tensor | DeferredNorm, residual: torch.Tensor | None,
    finish: RMSNorm | None, next_sublayer: nn.Module | None, *args: torch.Tensor,
) -> tuple[torch.Tensor | DeferredNorm, torch.Tensor]:
    """(sublayer(*args, norm(x + residual)), x + residual), residual None meaning 0; x a
    ``DeferredNorm`` already holds both. With ``finish`` the sublayer is asked to finish that
    norm's residual add for ``next_sublayer`` (its output may come as a DeferredNorm)."""
    proj = getattr(sublayer, "input_proj", None)
    if isinstance(x, DeferredNorm):
        y, residual = (proj(x) if proj is not None else x), x.summed
    elif proj is not None:
        y, residual = norm.project(x, residual, proj)
    else:
        y, residual = (norm(x), x) if residual is None else norm(x, residual)
    kwargs = {"add_norm": AddNorm(residual, finish.weight, finish.eps, _reader(next_sublayer))} \
        if finish is not None else {}
    if proj is not None:
        return sublayer.forward_projected(*args, y, **kwargs), residual
    return sublayer(*args, y, **kwargs), residual


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> final norm."""

    def __init__(self, config: Any, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        layers = list(self.layers)
        for layer, after in zip(layers, layers[1:] + [None]):
            # The last layer's output goes to the final norm, which is not deferred: the LM
            # head reads only the sampled rows, and cuBLAS at that.
            hidden_states, residual = layer(positions, hidden_states, residual, after)
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLMBase(nn.Module):
    """The ``CausalLM`` contract (atom_core.layers.model_api) over a DecoderModel.

    Subclasses build ``DecoderModel(config, their layers)`` and pass it in; they override
    ``load_weights`` when their checkpoints need more than the Llama-style fusions, and
    ``attention_layers`` when their attention module is not ``self_attn.attn``.
    """

    def __init__(self, config: Any, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_weights(self, weights)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn.attn for layer in self.model.layers]
