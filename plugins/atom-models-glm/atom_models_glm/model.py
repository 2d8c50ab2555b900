"""GLM-4.5 / GLM-4.6 for ATOM: grouped-query attention with a bias on q/k/v, RoPE on the
first half of each head (``partial_rotary_factor``) and, when ``use_qk_norm``, a per-head
RMSNorm of q and k before it; a dense SwiGLU MLP in the first ``first_k_dense_replace``
layers and a mixture of experts after them.

The MoE routes as DeepSeek-V3 does: sigmoid scores plus ``e_score_correction_bias`` choose
the experts, within the ``topk_group`` best of ``n_group`` groups (a group scored by its
best two); the chosen experts' weights, without the bias, are renormalised when
``norm_topk_prob`` and scaled by ``routed_scaling_factor``. The shared experts (one SwiGLU
of width ``n_shared_experts * moe_intermediate_size``) are folded into the routed
experts' call as always-chosen experts of weight 1 (``FusedMoE(num_shared_experts=n)``).

Parameter names follow transformers' except the fused ``qkv_proj`` / ``gate_up_proj`` and
the experts' stacked ``w13_weight`` / ``w2_weight`` (routed, then shared), which
``load_weights`` fills from the checkpoint's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.layer import Attention
from atom_core.layers.decoder import CausalLMBase, DecoderLayer, DecoderModel, GatedMLP
from atom_core.layers.linear import QKVParallelLinear, RowParallelLinear
from atom_core.layers.moe import FusedMoE, TopKRouter, load_hf_moe_weights
from atom_core.layers.norm import RMSNorm
from atom_core.layers.rotary import get_rope, rope_config, rotary_dim

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=bool(getattr(config, "attention_bias", False)))
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=False)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        norms = {}
        if getattr(config, "use_qk_norm", False):
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
            norms = {"q_norm": self.q_norm, "k_norm": self.k_norm}
        base, rope_scaling = rope_config(config)
        self.rotary_emb = get_rope(head_dim, rotary_dim(config, head_dim),
                                   config.max_position_embeddings, base, rope_scaling)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5,
                              self.qkv_proj.num_kv_heads, rope=self.rotary_emb, **norms)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], -1)
        return self.o_proj(self.attn(q, k, v, positions))


class Glm4MoeMoE(nn.Module):
    """``experts(x, *gate(x))``, the experts holding the shared experts too: the same sum as
    transformers' ``experts(x, ...) + shared_experts(x)``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.n_routed_experts
        self.gate = TopKRouter(
            hidden, num_experts, config.num_experts_per_tok, scoring_func="sigmoid",
            renormalize=bool(config.norm_topk_prob), num_expert_group=config.n_group,
            topk_group=config.topk_group, correction_bias=True,
            routed_scaling_factor=float(config.routed_scaling_factor),
        )
        self.experts = FusedMoE(num_experts, hidden, config.moe_intermediate_size,
                                num_shared_experts=config.n_shared_experts or 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))


def glm4_moe_layer(config: Any, layer_idx: int) -> DecoderLayer:
    if layer_idx >= config.first_k_dense_replace:
        mlp: nn.Module = Glm4MoeMoE(config)
    else:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, hidden_act=config.hidden_act)
    return DecoderLayer(config, Glm4MoeAttention(config), mlp)


class Glm4MoeForCausalLM(CausalLMBase):
    """The ``atom_core.layers.model_api.CausalLM`` contract for GLM-4.5 / 4.6 checkpoints."""

    def __init__(self, config: Any) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"GLM-4.5 with hidden_act={config.hidden_act!r} is not supported")
        layers = (glm4_moe_layer(config, i) for i in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        num_layers = self.config.num_hidden_layers

        def decoder_only() -> Iterator[tuple[str, torch.Tensor]]:
            # The checkpoints append their multi-token-prediction layer as layer
            # num_hidden_layers (transformers drops it too): a draft model's weights.
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    yield name, tensor

        return load_hf_moe_weights(self, decoder_only())
