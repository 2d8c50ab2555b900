"""Kimi-K2 is DeepSeek-V3's architecture at its own config (384 routed experts, 8 a token,
one shared, 64 heads, MLA, no expert groups, routed_scaling_factor 2.827), shipped with
model_type "kimi_k2" and an auto_map to its own copy of DeepSeek-V3's config.

On a tiny checkpoint of that shape, written as Moonshot ships it: logits against
transformers' DeepseekV3ForCausalLM (fp32, within 1e-4), and 32 greedy tokens through the
real LLMEngine with prefix caching and chunked prefill, identical. The real config builds
(on the meta device) to the published 1.04T total / 32B activated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from atom_core.layers.moe import FusedMoE
from atom_core.loader import architecture, build_model, hf_dir
from atom_core.testing.engine_reference import check_engine_against_transformers
from atom_core.testing.model_reference import check_against_transformers
from atom_core.testing.tiny_models import tiny_model_dir

CONFIGS = Path(__file__).resolve().parent / "configs"
AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}


def test_kimi_k2_matches_transformers():
    check_against_transformers("kimi_k2", block_size=16, tol=1e-4)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> Path:
    """The tiny checkpoint as Moonshot ships it: model_type kimi_k2 and an auto_map."""
    path = tiny_model_dir("kimi_k2")
    shipped = tmp_path_factory.mktemp("kimi") / "Kimi-K2-tiny"
    shutil.copytree(path, shipped)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map=AUTO_MAP)
    (shipped / "config.json").write_text(json.dumps(config, indent=2))
    return shipped


@pytest.mark.slow
def test_greedy_tokens_identical_to_transformers(shipped):
    engine = check_engine_against_transformers(shipped, hf_path=tiny_model_dir("kimi_k2"))
    assert engine.runner.attention_backend_name == "native_mla"


def test_real_config_builds_to_its_published_size():
    cfg = hf_dir.load_config(CONFIGS / "kimi-k2")
    assert architecture(cfg) == "DeepseekV3ForCausalLM" and cfg.model_type == "deepseek_v3"
    model = build_model(cfg, "cpu", torch.bfloat16, meta=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    idle = sum((m.num_experts - cfg.num_experts_per_tok)
               * (m.w13_weight[0].numel() + m.w2_weight[0].numel()) for m in moes)
    assert params / 1e12 == pytest.approx(1.04, rel=2e-2)
    assert (params - idle) / 1e9 == pytest.approx(32, rel=3e-2)
    assert len(moes) == 60 and all(
        (m.num_experts, m.num_shared_experts) == (384, 1) for m in moes)
    gate = model.model.layers[1].mlp.gate
    assert (gate.scoring_func, gate.top_k, gate.num_expert_group, gate.topk_group) == (
        "sigmoid", 8, 1, 1)
    assert gate.renormalize and gate.routed_scaling_factor == 2.827
    assert gate.e_score_correction_bias is not None
    assert all(a.kv_cache_shape(10, 16) == (10, 16, 576) for a in model.attention_layers())
    assert model.attention_layers()[0].num_heads == 64
