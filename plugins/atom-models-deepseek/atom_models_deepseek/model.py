"""DeepSeek-V2 and V3 for ATOM: MLA attention over a latent KV cache, a dense SwiGLU MLP in
the first ``first_k_dense_replace`` layers and a mixture of experts (routed + shared) in
every ``moe_layer_freq``-th layer after them (the shared experts folded into the routed
experts' fused call: see mlp.py).

V2 and V3 differ in routing (see mlp.py) and RoPE layout: V2 rotates interleaved pairs
(x0, x1), (x2, x3), ...; V3 too unless its config sets ``rope_interleave`` false. Parameter
names follow transformers' except the fused ``gate_up_proj`` and the experts' stacked
``w13_weight`` / ``w2_weight`` (routed, then shared experts), which ``load_weights`` fills
from the checkpoint's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.mla import MLAAttention
from atom_core.layers.decoder import CausalLMBase, DecoderLayer, DecoderModel
from atom_core.layers.moe import load_hf_moe_weights
from atom_models_deepseek.attention import DeepseekV2Attention
from atom_models_deepseek.mlp import DeepseekV2MLP, DeepseekV2MoE

# Only the dense MLPs fuse checkpoint tensors here (load_hf_moe_weights takes the experts'
# and shared experts' first); attention's projections load one to one.
GATE_UP_PARAMS = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    return (
        bool(getattr(config, "n_routed_experts", None))
        and layer_idx >= (getattr(config, "first_k_dense_replace", None) or 0)
        and layer_idx % (getattr(config, "moe_layer_freq", None) or 1) == 0
    )


def deepseek_layer(config: Any, layer_idx: int, version: int, is_neox: bool) -> DecoderLayer:
    if is_moe_layer(config, layer_idx):
        mlp: nn.Module = DeepseekV2MoE(config, version)
    else:
        mlp = DeepseekV2MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    return DecoderLayer(config, DeepseekV2Attention(config, is_neox), mlp)


class DeepseekV2ForCausalLM(CausalLMBase):
    """The ``atom_core.layers.model_api.CausalLM`` contract for DeepSeek-V2 checkpoints."""

    version = 2

    def __init__(self, config: Any) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"DeepSeek with hidden_act={config.hidden_act!r} is not supported")
        is_neox = self.rope_is_neox(config)
        layers = (deepseek_layer(config, i, self.version, is_neox)
                  for i in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers))

    @staticmethod
    def rope_is_neox(config: Any) -> bool:
        return False  # V2 rotates interleaved pairs (transformers: complex multiplication)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        num_layers = self.config.num_hidden_layers

        def decoder_only() -> Iterator[tuple[str, torch.Tensor]]:
            # V3 checkpoints append their multi-token-prediction module as layer
            # num_hidden_layers; it is a draft model's weight, not this model's.
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    yield name, tensor

        return load_hf_moe_weights(self, decoder_only(), GATE_UP_PARAMS)

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn.mla_attn for layer in self.model.layers]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and R1): sigmoid routing with a correction bias, RoPE interleaved unless
    ``rope_interleave`` is false."""

    version = 3

    @staticmethod
    def rope_is_neox(config: Any) -> bool:
        return not getattr(config, "rope_interleave", True)
