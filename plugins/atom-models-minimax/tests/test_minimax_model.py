"""Logits of ATOM's MiniMax-M2 against transformers' on a tiny random checkpoint (fp32,
CPU): q/k norms over the whole projection, partial RoPE, sigmoid routing with the
correction bias, the checkpoint's Mixtral-style names."""

import pytest
import torch
from atom_models_minimax import model as minimax

from atom_core.config import Config
from atom_core.errors import ConfigError
from atom_core.loader import load_model
from atom_core.testing.model_reference import check_against_transformers
from atom_core.testing.tiny_models import tiny_config, tiny_model_dir


@pytest.mark.parametrize("block_size", [4, 16])
def test_minimax_m2_matches_transformers(block_size):
    check_against_transformers("minimax_m2", block_size=block_size, tol=1e-4)


@pytest.fixture(scope="module")
def model():
    path = str(tiny_model_dir("minimax_m2"))
    return load_model(Config.from_kwargs(model=path), "cpu", torch.float32).model


def test_structure_follows_the_config(model):
    cfg = model.config
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.hidden_size == cfg.num_attention_heads * cfg.head_dim
    assert attn.k_norm.hidden_size == cfg.num_key_value_heads * cfg.head_dim
    assert attn.rotary_emb.rotary_dim == cfg.rotary_dim < cfg.head_dim
    for layer in model.model.layers:
        gate, experts = layer.mlp.gate, layer.mlp.experts
        assert (gate.scoring_func, gate.renormalize, gate.num_expert_group) == ("sigmoid", True,
                                                                                None)
        assert gate.e_score_correction_bias.abs().sum() > 0  # block_sparse_moe's, loaded
        assert experts.num_shared_experts == 0 and experts.num_experts == cfg.num_local_experts


def test_the_mtp_modules_are_not_loaded_and_unknown_names_fail(model):
    n = model.config.num_hidden_layers
    extra = [(f"model.layers.{n}.block_sparse_moe.experts.0.w1.weight", torch.zeros(32, 64)),
             (f"model.layers.{n + 2}.self_attn.q_proj.weight", torch.zeros(128, 64))]
    assert model.load_weights(iter(extra)) == set()
    with pytest.raises(KeyError, match="matches no parameter"):
        model.load_weights(iter([("model.layers.0.block_sparse_moe.bias", torch.zeros(1))]))


def test_tensor_parallelism_is_refused_with_a_reason(monkeypatch):
    monkeypatch.setattr(minimax, "tp_rank_and_size", lambda: (0, 2))
    with pytest.raises(ConfigError, match="q/k norms span all heads"):
        minimax.MiniMaxM2Attention(tiny_config("minimax_m2"))
