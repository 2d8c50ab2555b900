"""The real DeepSeek configs (tests/configs) build (on the meta device: no memory is
allocated for V3's 671B parameters) into models of the published size."""

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


def param_counts(cfg, model) -> tuple[float, float]:
    """(total, active per token) in billions."""
    total = sum(p.numel() for p in model.parameters())
    idle = sum(
        (m.num_experts - cfg.num_experts_per_tok)
        * (m.w13_weight[0].numel() + m.w2_weight[0].numel())
        for m in model.modules() if isinstance(m, FusedMoE)
    )
    return total / 1e9, (total - idle) / 1e9


@pytest.mark.parametrize(
    "name,arch,total,active,dense_layers",
    [
        ("deepseek-v2-lite", "DeepseekV2ForCausalLM", 15.71, 2.66, 1),
        ("deepseek-v3", "DeepseekV3ForCausalLM", 671.0, 37.55, 3),
    ],
)
def test_real_config_builds_to_its_published_size(name, arch, total, active, dense_layers):
    cfg, model = build_on_meta(name)
    assert architecture(cfg) == arch and type(model).__name__ == arch
    got_total, got_active = param_counts(cfg, model)
    assert got_total == pytest.approx(total, rel=2e-3)
    assert got_active == pytest.approx(active, rel=2e-3)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    moe_layers = cfg.num_hidden_layers - dense_layers
    assert kinds == ["DeepseekV2MLP"] * dense_layers + ["DeepseekV2MoE"] * moe_layers
    # 576 latent values per token and layer, whatever the head count.
    assert all(a.kv_cache_shape(10, 16) == (10, 16, 576) for a in model.attention_layers())
    # --load_dummy's weight list is the model's (nothing allocated in "empty" mode).
    assert init_dummy_weights(model, "empty") == {n for n, _ in model.named_parameters()}


def test_v2_lite_routing_and_v3_grouped_sigmoid_routing():
    _, lite = build_on_meta("deepseek-v2-lite")
    gate = lite.model.layers[1].mlp.gate
    routing = (gate.scoring_func, gate.num_expert_group, gate.e_score_correction_bias)
    assert routing == ("softmax", None, None)
    assert lite.model.layers[0].self_attn.q_lora_rank is None
    _, v3 = build_on_meta("deepseek-v3")
    gate = v3.model.layers[3].mlp.gate
    assert (gate.scoring_func, gate.num_expert_group, gate.topk_group) == ("sigmoid", 8, 4)
    assert gate.renormalize and gate.routed_scaling_factor == 2.5
    assert gate.e_score_correction_bias is not None
    # yarn: the softmax scale carries mscale(40, 1.0)^2 on top of 192^-0.5.
    mla = v3.model.layers[0].self_attn.mla_attn
    assert mla.scale == pytest.approx(192**-0.5 * (0.1 * torch.tensor(40.0).log().item() + 1) ** 2)
