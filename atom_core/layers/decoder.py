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


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up fused in one GEMM, and the
    activation fused into the down projection (the ``silu_and_mul_linear`` op, one kernel
    fewer a layer at decode); ``down_proj`` holds the weights and is not called itself.
    ``input_proj`` / ``forward_projected``: see ``DecoderLayer``."""

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

    def forward_projected(self, gate_up: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        # As RowParallelLinear.forward: with TP > 1 only rank 0 adds the bias.
        bias = down.bias if down.tp_rank == 0 else None
        return self._silu_and_mul_linear(gate_up, down.weight, bias)


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
    """

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = _pre_norm(self.input_layernorm, self.self_attn, hidden_states, residual, positions)
        return _pre_norm(self.post_attention_layernorm, self.mlp, hidden_states, residual)


def _pre_norm(
    norm: RMSNorm, sublayer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, *args: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sublayer(*args, norm(x + residual)), x + residual), residual None meaning 0."""
    proj = getattr(sublayer, "input_proj", None)
    if proj is not None:
        y, residual = norm.project(x, residual, proj)
        return sublayer.forward_projected(*args, y), residual
    y, residual = (norm(x), x) if residual is None else norm(x, residual)
    return sublayer(*args, y), residual


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> final norm."""

    def __init__(self, config: Any, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
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
