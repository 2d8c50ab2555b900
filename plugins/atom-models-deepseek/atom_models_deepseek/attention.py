"""DeepSeek's multi-head latent attention, wired from its checkpoint's projections to the
core's MLAAttention (which owns the paged latent cache and the absorbed decode).

Per token: q (through the optional q_lora bottleneck, ``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj``, else one ``q_proj``) splits per head into ``q_nope`` and ``q_pe``;
``kv_a_proj_with_mqa`` gives the latent ``kv_c`` (normalised by ``kv_a_layernorm``) and the
shared ``k_pe``; RoPE rotates ``q_pe`` and ``k_pe``; ``kv_b_proj`` (W_UK | W_UV per head)
is handed to the backend, which expands or absorbs it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.mla import MLAAttention
from atom_core.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_core.layers.norm import RMSNorm
from atom_core.layers.rotary import get_rope, rope_config

# DeepSeek's q_a/kv_a layernorms use the RMSNorm default eps, not config.rms_norm_eps
# (the reference code and transformers both construct them without it).
LATENT_NORM_EPS = 1e-6


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under scaled RoPE: DeepSeek
    moves yarn's attention temperature from cos/sin into the softmax scale (transformers'
    ``yarn_apply_mscale``). cos/sin keep yarn's own attention factor, mscale/mscale_all_dim."""
    scale = qk_head_dim**-0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_get_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    def __init__(self, config: Any, is_neox: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads_total = config.num_attention_heads
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = getattr(config, "attention_bias", False)
        heads = self.num_heads_total
        if self.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim)
            self.num_heads = self.q_b_proj.output_size // self.qk_head_dim  # this rank's
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * self.qk_head_dim)
            self.num_heads = self.q_proj.output_size // self.qk_head_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        # The MLA backend absorbs this weight into its query and output (mla_attn below).
        self.kv_b_proj.quantizable = False
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias)
        base, rope_scaling = rope_config(config)
        self.rotary_emb = get_rope(
            self.qk_rope_head_dim, self.qk_rope_head_dim, config.max_position_embeddings, base,
            rope_scaling, is_neox,
        )
        self.mla_attn = MLAAttention(
            self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
            self.kv_lora_rank, softmax_scale(self.qk_head_dim, rope_scaling),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        # q_pe by head ([T, heads, rope], strided): the rotary op reads it in place.
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        out = self.mla_attn(q_nope, q_pe, kv_c, k_pe, self.kv_b_proj.weight)
        return self.o_proj(out)
