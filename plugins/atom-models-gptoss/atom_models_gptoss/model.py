"""gpt-oss for ATOM: a pre-norm decoder whose attention has biases, a learned sink logit
per head, and a sliding window in the layers ``config.layer_types`` names
"sliding_attention" (every other one); RoPE as configured (YaRN in the published
checkpoints). Every layer's MLP is a mixture of experts (moe.py).

Parameter names follow transformers' except the fused ``qkv_proj`` and the experts'
stacks (moe.py), which ``load_weights`` fills from the checkpoint's tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.layer import Attention
from atom_core.layers.decoder import CausalLMBase, DecoderLayer, DecoderModel
from atom_core.layers.linear import QKVParallelLinear, RowParallelLinear, default_weight_loader
from atom_core.layers.model_api import load_hf_weights
from atom_core.layers.rotary import get_rope, rope_config
from atom_core.quant.mxfp4 import BF16_BOUND_ENV, bf16_bound
from atom_models_gptoss.moe import GptOssExperts, GptOssMoE, is_mxfp4, slice_of

logger = logging.getLogger(__name__)


class GptOssAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads,
            config.num_key_value_heads, config.attention_bias,
        )
        num_heads = self.qkv_proj.num_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        config.attention_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # A logit per head that joins the softmax as a key with no value: a head may
        # attend to nothing. This rank's heads' sinks.
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        rank = self.qkv_proj.tp_rank
        self.sinks.weight_loader = lambda p, t: default_weight_loader(
            p, t[slice_of(rank, num_heads)])
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        base, rope_scaling = rope_config(config)
        self.attn = Attention(
            num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads,
            rope=get_rope(head_dim, head_dim, config.max_position_embeddings, base, rope_scaling),
            sinks=self.sinks, sliding_window=config.sliding_window if sliding else None,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], -1)
        return self.o_proj(self.attn(q, k, v, positions))


class GptOssForCausalLM(CausalLMBase):
    """The ``atom_core.layers.model_api.CausalLM`` contract for gpt-oss checkpoints, MXFP4
    or unquantized."""

    def __init__(self, config: Any) -> None:
        mxfp4 = is_mxfp4(config)
        layers = (DecoderLayer(config, GptOssAttention(config, i), GptOssMoE(config, mxfp4))
                  for i in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers))
        if mxfp4:
            logger.info("gpt-oss experts: MXFP4 as shipped; activations in the model dtype "
                        "below %d tokens per step (%s), quantized above it only by a kernel "
                        "that does so (the native op does not)", bf16_bound(), BF16_BOUND_ENV)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = {name: m for name, m in self.named_modules() if isinstance(m, GptOssExperts)}
        loaded: set[str] = set()

        def others() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                prefix, _, part = name.rpartition(".")
                if prefix in experts:
                    loaded.add(f"{prefix}.{experts[prefix].load(part, tensor)}")
                else:
                    yield name, tensor

        return load_hf_weights(self, others()) | loaded
