"""The real MiniMax-M2 config (tests/configs) builds (on the meta device, nothing
allocated) into a model of the published size, 230B total / 10B active (published to the
nearest billion; the active count leaves out the embedding and the LM head). Its
``auto_map`` names the checkpoint's own code; transformers reads the config with its own
class, so none of it runs."""

from pathlib import Path

import pytest
import torch

from atom_core.layers.moe import FusedMoE
from atom_core.loader import architecture, build_model, hf_dir
from atom_core.loader.dummy import init_dummy_weights

CONFIGS = Path(__file__).resolve().parent / "configs"


def test_real_config_builds_to_its_published_size():
    cfg = hf_dir.load_config(CONFIGS / "minimax-m2")
    model = build_model(cfg, "cpu", torch.bfloat16, meta=True)
    assert architecture(cfg) == "MiniMaxM2ForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    idle = sum(
        (m.num_experts - cfg.num_experts_per_tok)
        * (m.w13_weight[0].numel() + m.w2_weight[0].numel())
        for m in model.modules() if isinstance(m, FusedMoE)
    )
    embeddings = 2 * cfg.vocab_size * cfg.hidden_size
    assert params / 1e9 == pytest.approx(230, rel=1e-2)
    assert (params - idle - embeddings) / 1e9 == pytest.approx(10, abs=0.5)
    attn = model.model.layers[0].self_attn
    assert attn.rotary_emb.rotary_dim == 64 and attn.q_norm.hidden_size == 48 * 128
    assert all(a.kv_cache_shape(10, 16) == (2, 10, 16, 8, 128) for a in model.attention_layers())
    assert init_dummy_weights(model, "empty") == {n for n, _ in model.named_parameters()}
