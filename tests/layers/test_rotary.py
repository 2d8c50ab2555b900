"""get_rope against transformers' rope functions and its Llama rotary application."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from atom_core.layers.rotary import get_rope, rope_config, rope_inv_freq, rotary_dim

HEAD, HEADS, KV_HEADS, MAX_POS = 32, 4, 2, 2048

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024,
        "attention_factor": 1.3, "truncate": False,
    },
}


def hf_config(scaling):
    rope = {"rope_type": "default", **(scaling or {}), "rope_theta": 50000.0}
    return LlamaConfig(
        hidden_size=HEAD * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS, rope_parameters=rope,
    )


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inv_freq_and_attention_factor_match_transformers(name):
    config = hf_config(SCALINGS[name])
    base, scaling = rope_config(config)
    assert base == 50000.0 and (scaling is None) == (name == "default")
    ours, factor = rope_inv_freq(HEAD, MAX_POS, base, scaling)
    if scaling is None:
        theirs, their_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    assert torch.equal(ours, theirs.float())
    assert factor == pytest.approx(their_factor, rel=1e-12)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rotation_matches_transformers_bit_for_bit(name):
    config = hf_config(SCALINGS[name])
    base, scaling = rope_config(config)
    rope = get_rope(HEAD, HEAD, MAX_POS, base, scaling, is_neox=True)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 1500, 2047])
    q, k = torch.randn(8, HEADS * HEAD), torch.randn(8, KV_HEADS * HEAD)
    got_q, got_k = rope(positions, q, k)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, 8, HEADS, HEAD).transpose(1, 2), k.view(1, 8, KV_HEADS, HEAD).transpose(1, 2),
        cos, sin,
    )
    torch.testing.assert_close(got_q, ref_q.transpose(1, 2).reshape(8, -1), atol=0, rtol=0)
    torch.testing.assert_close(got_k, ref_k.transpose(1, 2).reshape(8, -1), atol=0, rtol=0)


def test_old_style_config_attributes():
    class Old:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}
        max_position_embeddings = 16

    assert rope_config(Old()) == (1234.0, {"type": "linear", "factor": 2.0, "rope_type": "linear"})


def test_partial_rotary_and_gptj_style():
    rope = get_rope(16, 8, 64, 10000.0, None, is_neox=False)
    positions = torch.tensor([3, 9])
    q, k = torch.randn(2, 32), torch.randn(2, 16)
    got_q, got_k = rope(positions, q, k)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    angle = positions[:, None].float() * inv  # [2, 4]

    def ref(x):
        x = x.view(2, -1, 16)
        x1, x2 = x[..., 0:8:2], x[..., 1:8:2]
        c, s = angle.cos()[:, None], angle.sin()[:, None]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((rot, x[..., 8:]), dim=-1).reshape(2, -1)

    torch.testing.assert_close(got_q, ref(q))
    torch.testing.assert_close(got_k, ref(k))


def test_partial_rotary_matches_glm4_moe_bit_for_bit():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    config = Glm4MoeConfig(
        hidden_size=HEAD * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD, max_position_embeddings=MAX_POS, partial_rotary_factor=0.5,
        rope_theta=50000.0,
    )
    base, scaling = rope_config(config)
    assert rotary_dim(config, HEAD) == HEAD // 2 and scaling is None
    rope = get_rope(HEAD, rotary_dim(config, HEAD), MAX_POS, base, scaling, is_neox=True)
    positions = torch.tensor([0, 1, 5, 300, 2047])
    q, k = torch.randn(5, HEADS * HEAD), torch.randn(5, KV_HEADS * HEAD)
    got_q, got_k = rope(positions, q, k)
    cos, sin = glm.Glm4MoeRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = glm.apply_rotary_pos_emb(
        q.view(1, 5, HEADS, HEAD).transpose(1, 2), k.view(1, 5, KV_HEADS, HEAD).transpose(1, 2),
        cos, sin,
    )
    torch.testing.assert_close(got_q, ref_q.transpose(1, 2).reshape(5, -1), atol=0, rtol=0)
    torch.testing.assert_close(got_k, ref_k.transpose(1, 2).reshape(5, -1), atol=0, rtol=0)
    assert torch.equal(got_q.view(5, HEADS, HEAD)[..., HEAD // 2:],
                       q.view(5, HEADS, HEAD)[..., HEAD // 2:])  # the rest passes through


def test_rotary_dim_from_each_config_style():
    class Old:
        partial_rotary_factor = 0.25

    class GptJ:
        rotary_dim = 64

    assert rotary_dim(Old(), 128) == 32 and rotary_dim(GptJ(), 256) == 64
    assert rotary_dim(hf_config(None), HEAD) == HEAD
    new = type("New", (), {"rope_parameters": {"partial_rotary_factor": 0.5}, "rotary_dim": 8})
    assert rotary_dim(new(), 100) == 50  # the factor, truncated, wins


def test_layers_share_one_cache():
    a = get_rope(32, 32, 128, 10000.0, {"rope_type": "linear", "factor": 2.0})
    b = get_rope(32, 32, 128, 10000.0, {"rope_type": "linear", "factor": 2.0})
    assert a is b and a.cos_sin_cache.dtype == torch.float32
    assert get_rope(32, 32, 128, 10000.0) is not a
