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
from atom_core.testing.tiny_models import tiny_config, tiny_model_dir


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


def test_router_chooses_as_transformers_does_within_groups():
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = tiny_config("glm4_moe")
    torch.manual_seed(0)
    hf = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        hf.weight.normal_()
        hf.e_score_correction_bias.normal_(0.0, 0.5)  # big enough to change choices
    ours = Glm4MoeMoE(cfg).gate
    ours.weight.data.copy_(hf.weight)
    ours.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, cfg.hidden_size)
    _, want_weights, want_ids = hf(x)
    got_weights, got_ids = ours(x)
    got_ids, got_order = got_ids.sort(-1)
    want_ids, want_order = want_ids.sort(-1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights.gather(1, got_order), want_weights.gather(1, want_order))
    per_group = cfg.n_routed_experts // cfg.n_group  # at most topk_group groups a token
    assert all(len(set((row // per_group).tolist())) <= cfg.topk_group for row in got_ids)
