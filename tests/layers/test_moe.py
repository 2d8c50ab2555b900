"""The MoE layer: fused_moe against a dense per-token reference, routing against
transformers' routers, and expert weight loading from per-expert and stacked names."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atom_core.layers.moe import FusedMoE, TopKRouter, load_hf_moe_weights
from atom_core.ops.native.moe import fused_moe, select_experts
from atom_core.plugins import get_registries


def dense_reference(hidden, w13, w2, weights, ids):
    """Token by token, expert by expert, in fp64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e].double() @ hidden[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def random_routing(num_tokens, num_experts, top_k, g):
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    return torch.rand(num_tokens, top_k, generator=g), ids


@pytest.mark.parametrize("num_tokens,num_experts,top_k",
                         [(1, 4, 2), (7, 8, 3), (33, 16, 4), (5, 3, 3)])
def test_fused_moe_matches_dense_reference(num_tokens, num_experts, top_k):
    g = torch.Generator().manual_seed(num_tokens * 10 + num_experts)
    hidden_size, inter = 24, 10
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size, generator=g) / 4
    w2 = torch.randn(num_experts, hidden_size, inter, generator=g) / 4
    weights, ids = random_routing(num_tokens, num_experts, top_k, g)
    out = fused_moe(hidden, w13, w2, weights, ids)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    expected = dense_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_skips_ids_outside_the_local_experts():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 16, generator=g)
    w13, w2 = torch.randn(4, 12, 16, generator=g), torch.randn(4, 16, 6, generator=g)
    weights, ids = random_routing(6, 4, 2, g)
    ids[0, 1], ids[3, 0], ids[5] = -1, 4, -1  # another rank's expert / padding
    out = fused_moe(hidden, w13, w2, weights, ids)
    expected = dense_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[5], torch.zeros(16))


def test_fused_moe_bf16_and_registry():
    assert get_registries().ops.resolve("fused_moe", "cpu").fn is fused_moe
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 32, generator=g)
    w13, w2 = torch.randn(8, 16, 32, generator=g) / 6, torch.randn(8, 32, 8, generator=g) / 3
    weights, ids = random_routing(9, 8, 2, g)
    out = fused_moe(hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), ref, atol=5e-2, rtol=5e-2)


def _same_choice(got, want):
    """Same experts with the same weights per token, whatever order top-k returned them in."""
    (gw, gi), (ww, wi) = got, want
    gi, go = gi.sort(dim=-1)
    wi, wo = wi.sort(dim=-1)
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw.gather(1, go), ww.float().gather(1, wo), atol=1e-6, rtol=1e-6)


def _load_router_weights(hf_router, ours):
    with torch.no_grad():
        ours.weight.copy_(hf_router.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)


def test_deepseek_v3_grouped_router_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    hf = DeepseekV3TopkRouter(cfg)
    nn.init.normal_(hf.weight)
    with torch.no_grad():
        hf.e_score_correction_bias.copy_(torch.randn(16) * 0.5)  # big enough to change choices
    ours = TopKRouter(
        32, 16, 4, scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
        correction_bias=True, routed_scaling_factor=2.5,
    )
    _load_router_weights(hf, ours)
    x = torch.randn(64, 32)
    _, hf_weights, hf_ids = hf(x)
    _same_choice(ours(x), (hf_weights, hf_ids))
    # The bias changed some choices (so the test exercises it), and groups restrict them.
    plain = select_experts(F.linear(x, hf.weight), 4, "sigmoid", True, 4, 2, None, 2.5)[1]
    assert not torch.equal(plain.sort(-1)[0], hf_ids.sort(-1)[0])
    assert all(len(set((row // 4).tolist())) <= 2 for row in hf_ids)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router_matches_transformers(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(
        hidden_size=32, n_routed_experts=12, n_group=3, topk_group=1, num_experts_per_tok=3,
        topk_method=method, routed_scaling_factor=1.5,
    )
    torch.manual_seed(1)
    hf = DeepseekV2TopkRouter(cfg)
    nn.init.normal_(hf.weight)
    grouped = method == "group_limited_greedy"
    ours = TopKRouter(
        32, 12, 3, scoring_func="softmax", num_expert_group=3 if grouped else None,
        topk_group=1 if grouped else None, routed_scaling_factor=1.5,
    )
    _load_router_weights(hf, ours)
    x = torch.randn(40, 32)
    _, hf_weights, hf_ids = hf(x)
    _same_choice(ours(x), (hf_weights, hf_ids))
    if grouped:
        assert all(len(set((row // 4).tolist())) == 1 for row in hf_ids)


@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_moe_router_matches_transformers(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    torch.manual_seed(2)
    hf = Qwen3MoeTopKRouter(cfg)
    nn.init.normal_(hf.weight)
    ours = TopKRouter(32, 8, 3, scoring_func="softmax", renormalize=norm)
    _load_router_weights(hf, ours)
    x = torch.randn(40, 32)
    _, hf_weights, hf_ids = hf(x)
    _same_choice(ours(x), (hf_weights, hf_ids))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = FusedMoE(num_experts=3, hidden_size=8, intermediate_size=4)
        self.gate = TopKRouter(8, 3, 2)


def test_expert_weights_load_from_per_expert_and_stacked_names():
    g = torch.Generator().manual_seed(5)
    gate = [torch.randn(4, 8, generator=g) for _ in range(3)]
    up = [torch.randn(4, 8, generator=g) for _ in range(3)]
    down = [torch.randn(8, 4, generator=g) for _ in range(3)]
    router = torch.randn(3, 8, generator=g)

    model = nn.Module()
    model.mlp = _Block()
    weights = [("mlp.gate.weight", router)]
    for e in range(3):
        weights += [
            (f"mlp.experts.{e}.gate_proj.weight", gate[e]),
            (f"mlp.experts.{e}.up_proj.weight", up[e]),
            (f"mlp.experts.{e}.down_proj.weight", down[e]),
        ]
    loaded = load_hf_moe_weights(model, weights)
    assert loaded == {"mlp.gate.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    w13, w2 = model.mlp.experts.w13_weight, model.mlp.experts.w2_weight
    for e in range(3):
        assert torch.equal(w13[e], torch.cat((gate[e], up[e])))
        assert torch.equal(w2[e], down[e])

    # An expert missing its up_proj leaves w13 unloaded (so the loader reports it missing).
    partial = [w for w in weights if w[0] != "mlp.experts.2.up_proj.weight"]
    assert "mlp.experts.w13_weight" not in load_hf_moe_weights(model, partial)

    # transformers' stacked layout loads the same numbers.
    other = nn.Module()
    other.mlp = _Block()
    stacked = [
        ("mlp.gate.weight", router),
        ("mlp.experts.gate_up_proj", w13.detach().clone()),
        ("mlp.experts.down_proj", w2.detach().clone()),
    ]
    assert load_hf_moe_weights(other, stacked) == loaded
    assert torch.equal(other.mlp.experts.w13_weight, w13)
    assert torch.equal(other.mlp.experts.w2_weight, w2)

    with pytest.raises(KeyError, match="experts.7.gate_proj"):
        load_hf_moe_weights(model, [("mlp.shared.experts.7.gate_proj.weight", gate[0])])


def test_fused_moe_layer_runs_the_registered_op():
    layer = FusedMoE(num_experts=4, hidden_size=8, intermediate_size=6)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(4, 12, 8, generator=g))
        layer.w2_weight.copy_(torch.randn(4, 8, 6, generator=g))
    x = torch.randn(5, 8, generator=g)
    weights, ids = random_routing(5, 4, 2, g)
    torch.testing.assert_close(
        layer(x, weights, ids).double(),
        dense_reference(x, layer.w13_weight, layer.w2_weight, weights, ids), atol=1e-5, rtol=1e-5,
    )
