"""DeepSeek-V2 and V3 for ATOM: MLA attention over a latent KV cache, a dense SwiGLU MLP in
the first ``first_k_dense_replace`` layers and a mixture of experts (routed + shared) in
every ``moe_layer_freq``-th layer after them.

V2 and V3 differ in routing (see mlp.py) and RoPE layout: V2 rotates interleaved pairs
(x0, x1), (x2, x3), ...; V3 too unless its config sets ``rope_interleave`` false. Parameter
names follow transformers' except the fused ``gate_up_proj`` and the experts' stacked
``w13_weight`` / ``w2_weight``, which ``load_weights`` fills from the checkpoint's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.mla import MLAAttention
from atom_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.layers.moe import load_hf_moe_weights
from atom_core.layers.norm import RMSNorm
from atom_models_deepseek.attention import DeepseekV2Attention
from atom_models_deepseek.mlp import DeepseekV2MLP, DeepseekV2MoE

# Only the dense MLPs fuse checkpoint tensors; attention's projections load one to one.
GATE_UP_PARAMS = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    return (
        bool(getattr(config, "n_routed_experts", None))
        and layer_idx >= (getattr(config, "first_k_dense_replace", None) or 0)
        and layer_idx % (getattr(config, "moe_layer_freq", None) or 1) == 0
    )


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, version: int, is_neox: bool) -> None:
        super().__init__()
        self.self_attn = DeepseekV2Attention(config, is_neox)
        if is_moe_layer(config, layer_idx):
            self.mlp: nn.Module = DeepseekV2MoE(config, version)
        else:
            self.mlp = DeepseekV2MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
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


class DeepseekV2Model(nn.Module):
    def __init__(self, config: Any, version: int, is_neox: bool) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"DeepSeek with hidden_act={config.hidden_act!r} is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, version, is_neox)
            for i in range(config.num_hidden_layers)
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


class DeepseekV2ForCausalLM(nn.Module):
    """The ``atom_core.layers.model_api.CausalLM`` contract for DeepSeek-V2 checkpoints."""

    version = 2

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV2Model(config, self.version, self.rope_is_neox(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def rope_is_neox(config: Any) -> bool:
        return False  # V2 rotates interleaved pairs (transformers: complex multiplication)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

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
