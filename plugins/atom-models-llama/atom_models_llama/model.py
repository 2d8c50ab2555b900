"""Llama for ATOM: HF's LlamaForCausalLM, written with ATOM's fused, TP-aware layers.

Parameter names follow transformers' (``model.layers.N.self_attn...``) except for the
fused ``qkv_proj`` and ``gate_up_proj``, which ``load_weights`` fills from the separate
q/k/v and gate/up tensors of a checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.layer import Attention
from atom_core.layers.decoder import CausalLMBase, DecoderLayer, DecoderModel, GatedMLP
from atom_core.layers.linear import QKVParallelLinear, RowParallelLinear
from atom_core.layers.rotary import get_rope, rope_config
from atom_core.ops.deferred_norm import AddNorm, DeferredNorm


class LlamaAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads, bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        base, rope_scaling = rope_config(config)
        self.rotary_emb = get_rope(
            head_dim, head_dim, config.max_position_embeddings, base, rope_scaling, is_neox=True
        )
        self.attn = Attention(
            self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads
        )

    defers_norm = True  # DecoderLayer: o_proj may finish the next norm

    @property
    def input_proj(self) -> QKVParallelLinear:
        """The decoder layer fuses its input norm into this projection (``DecoderLayer``)."""
        return self.qkv_proj

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(positions, self.qkv_proj(hidden_states))

    def forward_projected(
        self, positions: torch.Tensor, qkv: torch.Tensor, add_norm: AddNorm | None = None
    ) -> torch.Tensor | DeferredNorm:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v), add_norm)


def llama_layer(config: Any) -> DecoderLayer:
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False),
                   config.hidden_act)
    return DecoderLayer(config, LlamaAttention(config), mlp)


class LlamaForCausalLM(CausalLMBase):
    """The ``atom_core.layers.model_api.CausalLM`` contract for Llama checkpoints."""

    def __init__(self, config: Any) -> None:
        layers = (llama_layer(config) for _ in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers))
