"""Logits of ATOM's DeepSeek-V2/V3 against transformers' on tiny random checkpoints (fp32,
CPU): MLA over the paged latent cache (expanded prefill, absorbed decode, a chunk over a
cached prefix), grouped routing, shared experts, yarn RoPE with DeepSeek's mscale."""

import pytest
import torch

from atom_core.config import Config
from atom_core.layers.attention.mla import MLAAttention
from atom_core.loader import load_model
from atom_core.testing.model_reference import check_against_transformers
from atom_core.testing.tiny_models import tiny_model_dir


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_deepseek_matches_transformers(kind, block_size):
    check_against_transformers(kind, block_size=block_size, tol=1e-4)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_structure_follows_the_config(kind):
    model = load_model(
        Config.from_kwargs(model=str(tiny_model_dir(kind))), "cpu", torch.float32
    ).model
    cfg = model.config
    layers = model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV2MLP"  # first_k_dense_replace = 1
    assert all(type(layer.mlp).__name__ == "DeepseekV2MoE" for layer in layers[1:])
    gate = layers[1].mlp.gate
    assert gate.num_expert_group == cfg.n_group and gate.topk_group == cfg.topk_group
    if kind == "deepseek_v3":
        assert gate.scoring_func == "sigmoid" and gate.e_score_correction_bias is not None
        assert gate.e_score_correction_bias.abs().sum() > 0  # loaded, not left at zero
        assert hasattr(layers[0].self_attn, "q_a_proj")
    else:
        assert gate.scoring_func == "softmax" and gate.e_score_correction_bias is None
        assert hasattr(layers[0].self_attn, "q_proj")
    attn = model.attention_layers()
    assert len(attn) == cfg.num_hidden_layers and all(isinstance(a, MLAAttention) for a in attn)
    # The latent cache: kv_lora_rank + qk_rope_head_dim values per token, one "head".
    assert attn[0].kv_cache_shape(7, 16) == (7, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
