"""Logits of ATOM's Qwen3-MoE against transformers' on a tiny random checkpoint (fp32, CPU),
and the sparse/dense layer pattern against transformers' rule."""

import pytest
import torch
from atom_models_qwen.qwen3_moe import Qwen3MoeSparseMoeBlock, is_sparse_layer
from transformers import Qwen3MoeConfig

from atom_core.config import Config
from atom_core.loader import load_model
from atom_core.testing.model_reference import check_against_transformers
from atom_core.testing.tiny_models import tiny_model_dir


@pytest.mark.parametrize("block_size", [4, 16])
def test_qwen3_moe_matches_transformers(block_size):
    check_against_transformers("qwen3_moe", block_size=block_size, tol=1e-4)


@pytest.mark.parametrize(
    "step,mlp_only,sparse",
    [(1, [], [0, 1, 2, 3, 4, 5]), (2, [], [1, 3, 5]), (1, [0, 4], [1, 2, 3, 5]), (3, [5], [2])],
)
def test_sparse_layers_follow_transformers(step, mlp_only, sparse):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    cfg = Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=step, mlp_only_layers=mlp_only,
    )
    assert [i for i in range(6) if is_sparse_layer(cfg, i)] == sparse
    hf = [i for i in range(6) if "Sparse" in type(Qwen3MoeDecoderLayer(cfg, i).mlp).__name__]
    assert hf == sparse


def test_tiny_checkpoint_has_a_dense_layer_among_sparse_ones():
    model = load_model(
        Config.from_kwargs(model=str(tiny_model_dir("qwen3_moe"))), "cpu", torch.float32
    ).model
    kinds = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers]
    assert kinds == [True, False, True]
    assert model.model.layers[0].mlp.gate.renormalize
