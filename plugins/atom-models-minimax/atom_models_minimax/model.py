"""MiniMax-M2 for ATOM, as transformers defines it: grouped-query attention whose q and k
are RMS-normalised over the whole projection (all heads at once, one weight per channel:
``q_norm`` over heads x head_dim, ``k_norm`` over kv_heads x head_dim) before RoPE on the
first ``rotary_dim`` of each head; a mixture of experts in every layer, with no shared
experts. The router chooses by sigmoid scores plus ``e_score_correction_bias`` and weighs
the chosen experts by their sigmoid scores, renormalised.

The checkpoints name the MoE block ``block_sparse_moe`` and its experts Mixtral's way
(``experts.<e>.w1/w2/w3``), with the correction bias on the block; ``load_weights`` maps
them onto the module names here (``mlp.gate``, ``mlp.experts``' stacked ``w13_weight`` /
``w2_weight``), as transformers' own conversion does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom_core.distributed.state import tp_rank_and_size
from atom_core.errors import ConfigError
from atom_core.layers.attention.layer import Attention
from atom_core.layers.decoder import CausalLMBase, DecoderLayer, DecoderModel
from atom_core.layers.linear import QKVParallelLinear, RowParallelLinear
from atom_core.layers.moe import FusedMoE, TopKRouter, load_hf_moe_weights
from atom_core.layers.norm import RMSNorm
from atom_core.layers.rotary import get_rope, rope_config, rotary_dim

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MiniMaxM2Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if tp_rank_and_size()[1] > 1:
            # Each rank would hold a slice of the normalised width; the norm needs the
            # sum of squares over all of it (an all-reduce), which is not built.
            raise ConfigError("MiniMax-M2's q/k norms span all heads: tensor parallelism is "
                              "not supported (use --enable-dp-attention to split the experts)")
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        base, rope_scaling = rope_config(config)
        self.rotary_emb = get_rope(head_dim, rotary_dim(config, head_dim),
                                   config.max_position_embeddings, base, rope_scaling)
        self.attn = Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads,
                              rope=self.rotary_emb)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], -1)
        return self.o_proj(self.attn(self.q_norm(q), self.k_norm(k), v, positions))


class MiniMaxM2SparseMoeBlock(nn.Module):
    """``experts(x, *gate(x))``: sigmoid routing with the correction bias, renormalised."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.num_local_experts
        self.gate = TopKRouter(hidden, num_experts, config.num_experts_per_tok,
                               scoring_func="sigmoid", renormalize=True, correction_bias=True)
        self.experts = FusedMoE(num_experts, hidden, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))


# Checkpoint name -> module name, as transformers' conversion mapping renames them.
_RENAMES = ((".block_sparse_moe.", ".mlp."),
            (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))


class MiniMaxM2ForCausalLM(CausalLMBase):
    """The ``atom_core.layers.model_api.CausalLM`` contract for MiniMax-M2 checkpoints."""

    def __init__(self, config: Any) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"MiniMax-M2 with hidden_act={config.hidden_act!r} is not supported")
        layers = (DecoderLayer(config, MiniMaxM2Attention(config), MiniMaxM2SparseMoeBlock(config))
                  for _ in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        num_layers = self.config.num_hidden_layers

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m is not None and int(m.group(1)) >= num_layers:
                    continue  # the multi-token-prediction modules after the decoder
                for old, new in _RENAMES:
                    name = name.replace(old, new)
                yield name, tensor

        return load_hf_moe_weights(self, renamed())
