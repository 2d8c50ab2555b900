"""The published gpt-oss configs (tests/configs, config.json of openai/gpt-oss-20b and -120b)
build on the meta device, nothing allocated, into models of the published sizes, with
MXFP4 experts, alternating sliding and full attention, and sinks."""

from pathlib import Path

import pytest
import torch
from atom_models_gptoss.moe import GptOssExperts

from atom_core.loader import architecture, build_model, hf_dir
from atom_core.loader.dummy import init_dummy_weights

CONFIGS = Path(__file__).resolve().parent / "configs"


@pytest.mark.parametrize("name,total,active", [
    ("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13),  # the model card's figures
])
def test_real_config_builds_to_its_published_size(name, total, active):
    cfg = hf_dir.load_config(CONFIGS / name)
    model = build_model(cfg, "cpu", torch.bfloat16, meta=True)
    assert architecture(cfg) == "GptOssForCausalLM"
    experts = [m for m in model.modules() if isinstance(m, GptOssExperts)]
    assert len(experts) == cfg.num_hidden_layers and all(m.mxfp4 for m in experts)
    packed = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in experts)  # 2 per byte
    scales = sum(m.w13_weight_scale.numel() + m.w2_weight_scale.numel() for m in experts)
    params = sum(p.numel() for p in model.parameters()) + packed - scales
    # Active: 4 of the experts (weights and biases), and the LM head but not the embedding
    # (the card's count).
    biases = sum(m.w13_bias.numel() + m.w2_bias.numel() for m in experts)
    idle = (packed * 2 + biases) * (1 - cfg.num_experts_per_tok / cfg.num_local_experts)
    embedding = model.model.embed_tokens.weight.numel()
    assert params / 1e9 == pytest.approx(total, rel=2e-3)
    assert (params - idle - embedding) / 1e9 == pytest.approx(active, rel=2e-3)
    windows = [a.backend.sliding_window for a in model.attention_layers()]
    assert windows == [128, None] * (cfg.num_hidden_layers // 2)
    assert all(a.kv_cache_shape(10, 16) == (2, 10, 16, 8, 64) for a in model.attention_layers())
    assert init_dummy_weights(model, "empty") == {n for n, _ in model.named_parameters()}
