"""Qwen3-MoE for ATOM: Qwen3's attention (per-head q/k norms) with a mixture of experts in
place of the MLP in every ``decoder_sparse_step``-th layer not listed in
``mlp_only_layers``; no shared experts. The router takes softmax top-k, renormalised when
``norm_topk_prob``.

Parameter names follow transformers' except the fused ``qkv_proj`` / ``gate_up_proj`` and
the experts' stacked ``w13_weight`` / ``w2_weight``, filled by ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.layer import Attention
from atom_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.layers.moe import FusedMoE, TopKRouter, load_hf_moe_weights
from atom_core.layers.norm import RMSNorm
from atom_models_qwen.model import Qwen3Attention, Qwen3MLP


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' rule: MoE unless listed in mlp_only_layers, every decoder_sparse_step-th."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0
    )


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3-MoE with hidden_act={config.hidden_act!r} is not supported")
        self.gate = TopKRouter(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            scoring_func="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        if is_sparse_layer(config, layer_idx):
            self.mlp: nn.Module = Qwen3MoeSparseMoeBlock(config)
        else:
            self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: x + residual, then normalised.
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3-MoE with sliding-window attention is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3MoeForCausalLM(nn.Module):
    """The ``atom_core.layers.model_api.CausalLM`` contract for Qwen3-MoE checkpoints."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_moe_weights(self, weights)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
