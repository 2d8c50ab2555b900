"""Logits of ATOM's GLM-4.5 against transformers' on tiny random checkpoints (fp32, CPU):
partial RoPE, per-head q/k norms (GLM-4.5) or none (Air), q/k/v bias, a dense first layer,
grouped sigmoid routing with a correction bias, the shared expert."""

import pytest
import torch
from atom_models_glm.model import Glm4MoeMoE

from atom_core.config import Config
from atom_core.layers.moe import FusedMoE
from atom_core.loader import load_model
from atom_core.testing.model_reference import check_against_transformers
from atom_core.testing.tiny_models import tiny_model_dir


@pytest.mark.parametrize("kind,block_size", [("glm4_moe", 4), ("glm4_moe", 16),
                                             ("glm4_moe_air", 16)])
def test_glm4_moe_matches_transformers(kind, block_size):
    check_against_transformers(kind, block_size=block_size, tol=1e-4)


def load(kind: str) -> torch.nn.Module:
    return load_model(
        Config.from_kwargs(model=str(tiny_model_dir(kind))), "cpu", torch.float32
    ).model


def test_structure_follows_the_config():
    model = load("glm4_moe")
    cfg, layers = model.config, model.model.layers
    assert [isinstance(layer.mlp, Glm4MoeMoE) for layer in layers] == [False, True, True]
    gate, experts = layers[1].mlp.gate, layers[1].mlp.experts
    assert (gate.scoring_func, gate.num_expert_group, gate.topk_group) == ("sigmoid", 4, 2)
    assert gate.renormalize and gate.routed_scaling_factor == 2.5
    assert gate.e_score_correction_bias.abs().sum() > 0  # loaded, not left at zero
    assert isinstance(experts, FusedMoE) and experts.num_shared_experts == cfg.n_shared_experts
    attn = layers[0].self_attn
    assert attn.rotary_emb.rotary_dim == 16 and attn.rotary_emb.head_size == 32
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert hasattr(attn, "q_norm") and not hasattr(load("glm4_moe_air").model.layers[0]
                                                   .self_attn, "q_norm")


def test_the_checkpoints_mtp_layer_is_not_loaded():
    model = load("glm4_moe")
    n = model.config.num_hidden_layers
    extra = [(f"model.layers.{n}.eh_proj.weight", torch.zeros(64, 128)),
             (f"model.layers.{n}.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64))]
    assert model.load_weights(iter(extra)) == set()
    with pytest.raises(KeyError, match="matches no parameter"):
        model.load_weights(iter([(f"model.layers.{n - 1}.eh_proj.weight", torch.zeros(1))]))
