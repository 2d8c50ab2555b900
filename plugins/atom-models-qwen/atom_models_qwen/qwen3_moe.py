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

from atom_core.layers.decoder import CausalLMBase, DecoderLayer, DecoderModel
from atom_core.layers.moe import FusedMoE, TopKRouter, load_hf_moe_weights
from atom_models_qwen.model import Qwen3Attention, check_no_sliding_window, qwen3_mlp


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
        self.experts = FusedMoE(config.num_experts, config.hidden_size,
                                config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))


def qwen3_moe_layer(config: Any, layer_idx: int) -> DecoderLayer:
    sparse = is_sparse_layer(config, layer_idx)
    mlp = Qwen3MoeSparseMoeBlock(config) if sparse else qwen3_mlp(config)
    return DecoderLayer(config, Qwen3Attention(config), mlp)


class Qwen3MoeForCausalLM(CausalLMBase):
    """The ``atom_core.layers.model_api.CausalLM`` contract for Qwen3-MoE checkpoints."""

    def __init__(self, config: Any) -> None:
        check_no_sliding_window(config)
        layers = (qwen3_moe_layer(config, i) for i in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_moe_weights(self, weights)
