"""The real GLM-4.5 and GLM-4.5-Air configs (tests/configs) build (on the meta device,
nothing allocated) into models of the published size: 355B total / 32B active and 106B /
12B. The checkpoints' multi-token-prediction layer is not part of the model, and the
published active counts leave out the embedding and the LM head."""

from pathlib import Path

import pytest
import torch
from atom_models_glm.model import Glm4MoeMoE

from atom_core.layers.moe import FusedMoE
from atom_core.loader import architecture, build_model, hf_dir
from atom_core.loader.dummy import init_dummy_weights

CONFIGS = Path(__file__).resolve().parent / "configs"


@pytest.mark.parametrize(
    "name,total,active,dense_layers,qk_norm",
    [("glm-4.5", 355, 32, 3, True), ("glm-4.5-air", 106, 12, 1, False)],
)
def test_real_config_builds_to_its_published_size(name, total, active, dense_layers, qk_norm):
    cfg = hf_dir.load_config(CONFIGS / name)
    model = build_model(cfg, "cpu", torch.bfloat16, meta=True)
    assert architecture(cfg) == "Glm4MoeForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    idle = sum(
        (m.num_experts - cfg.num_experts_per_tok)
        * (m.w13_weight[0].numel() + m.w2_weight[0].numel())
        for m in model.modules() if isinstance(m, FusedMoE)
    )
    embeddings = 2 * cfg.vocab_size * cfg.hidden_size
    assert params / 1e9 == pytest.approx(total, rel=1e-2)
    assert (params - idle - embeddings) / 1e9 == pytest.approx(active, rel=2e-2)
    kinds = [isinstance(layer.mlp, Glm4MoeMoE) for layer in model.model.layers]
    assert kinds == [False] * dense_layers + [True] * (cfg.num_hidden_layers - dense_layers)
    attn = model.model.layers[0].self_attn
    assert attn.rotary_emb.rotary_dim == 64 and hasattr(attn, "q_norm") == qk_norm
    assert all(a.kv_cache_shape(10, 16) == (2, 10, 16, 8, 128) for a in model.attention_layers())
    assert init_dummy_weights(model, "empty") == {n for n, _ in model.named_parameters()}
