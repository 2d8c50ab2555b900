"""Llama for ATOM: transformers' LlamaForCausalLM on ATOM's tensor-parallel layers.

Parameter names follow transformers' except the fused ``qkv_proj`` and ``gate_up_proj``,
which ``load_weights`` fills from a checkpoint's separate q/k/v and gate/up tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.layer import Attention
from atom_core.layers.decoder import CausalLMBase, DecoderLayer, DecoderModel, GatedMLP
from atom_core.layers.linear import QKVParallelLinear, RowParallelLinear
from atom_core.layers.rotary import get_rope, rope_config


class LlamaAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        base, rope_scaling = rope_config(config)
        self.rotary_emb = get_rope(head_dim, head_dim, config.max_position_embeddings, base,
                                   rope_scaling)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5,
                              self.qkv_proj.num_kv_heads, rope=self.rotary_emb)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], -1)
        return self.o_proj(self.attn(q, k, v, positions))


def llama_mlp(config: Any) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size,
                    getattr(config, "mlp_bias", False), config.hidden_act)


class LlamaForCausalLM(CausalLMBase):
    """The ``atom_core.layers.model_api.CausalLM`` contract for Llama checkpoints."""

    def __init__(self, config: Any) -> None:
        layers = (DecoderLayer(config, LlamaAttention(config), llama_mlp(config))
                  for _ in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers))
