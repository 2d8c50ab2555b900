"""The real Qwen3 configs (tests/configs) build (on the meta device, nothing allocated)
into models of the published size."""

from pathlib import Path

import pytest
import torch

from atom_core.layers.moe import FusedMoE
from atom_core.loader import architecture, build_model, hf_dir
from atom_core.loader.dummy import init_dummy_weights

CONFIGS = Path(__file__).resolve().parent / "configs"  # copies of bench/configs' files


def build_on_meta(name: str):
    """What load_model builds, with parameters on the meta device (ops resolved for CPU)."""
    cfg = hf_dir.load_config(CONFIGS / name)
    return cfg, build_model(cfg, "cpu", torch.bfloat16, meta=True)


@pytest.mark.parametrize(
    "name,arch,total,active",
    [
        ("qwen3-0.6b", "Qwen3ForCausalLM", 0.596, 0.596),
        ("qwen3-8b", "Qwen3ForCausalLM", 8.191, 8.191),
        ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.532, 3.353),
    ],
)
def test_real_config_builds_to_its_published_size(name, arch, total, active):
    cfg, model = build_on_meta(name)
    assert architecture(cfg) == arch and type(model).__name__ == arch
    params = sum(p.numel() for p in model.parameters())
    idle = sum(
        (m.num_experts - cfg.num_experts_per_tok)
        * (m.w13_weight[0].numel() + m.w2_weight[0].numel())
        for m in model.modules() if isinstance(m, FusedMoE)
    )
    assert params / 1e9 == pytest.approx(total, rel=2e-3)
    assert (params - idle) / 1e9 == pytest.approx(active, rel=2e-3)
    kv_heads = cfg.num_key_value_heads
    assert all(a.kv_cache_shape(10, 16) == (2, 10, 16, kv_heads, 128)
               for a in model.attention_layers())
    assert init_dummy_weights(model, "empty") == {n for n, _ in model.named_parameters()}
