"""The parts every decoder-only model shares: the gated MLP, the pre-norm block, the stack,
the LM head.

A model plugin writes its attention (and MLP where it is not the gated one) and builds on
these. They state the model; ``atom_core.fusion`` makes the fast decode step from them at
load time. Module names follow transformers' (``model.embed_tokens``,
``model.layers.N.input_layernorm``, ``lm_head``), so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from atom_core.layers.activation import SiluAndMul
from atom_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from atom_core.layers.model_api import load_hf_weights
from atom_core.layers.norm import RMSNorm
from atom_core.ops.deferred_norm import DeferredNorm


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up in one GEMM."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False,
        hidden_act: str = "silu",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(...)). The residual add is done
    by the next norm (``RMSNorm(x, residual)``), so the stream passes as (out, residual).
    ``self_attn(positions, x)`` and ``mlp(x)`` are the model's own."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def residual_stream(
    hidden_states: torch.Tensor | DeferredNorm, residual: torch.Tensor | None
) -> torch.Tensor:
    """The residual stream a layer receives as (hidden_states, residual): their sum, the
    embedding before the first layer (residual None), or a ``DeferredNorm``'s ``summed``."""
    if isinstance(hidden_states, DeferredNorm):
        return hidden_states.summed
    return hidden_states if residual is None else hidden_states + residual


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> final norm.

    ``aux_hidden_layers``: layers whose input (the residual stream) ``forward`` keeps in
    ``aux_hidden_states``, one tensor [T, hidden] per entry in its order, for a draft
    network that reads them (EAGLE-3). Empty by default, and then nothing is kept. They
    belong to the latest forward: under a CUDA graph, read them inside the same capture.
    """

    def __init__(self, config: Any, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        aux, kept = self.aux_hidden_layers, {}
        for i, layer in enumerate(self.layers):
            if aux and i in aux:
                kept[i] = residual_stream(hidden_states, residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
        if aux:
            self.aux_hidden_states = [kept[i] for i in aux]
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
