"""FusedMoE with shared experts folded in: the same output as the routed experts plus a
separate shared MLP (native op, tensor-parallel slices), and the shared MLP's checkpoint
tensors loaded into the always-selected expert slots."""

import pytest
import torch
from torch import nn

import atom_core.layers.moe as moe_module
from atom_core.distributed.state import TensorParallel
from atom_core.layers.decoder import GatedMLP
from atom_core.layers.moe import FusedMoE, load_hf_moe_weights
from atom_core.testing.op_cases import moe_checkpoint

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 6, 16, 8, 2


def checkpoint(num_shared: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    return moe_checkpoint(NUM_EXPERTS, HIDDEN, INTER, num_shared, seed)


def fused_model(num_shared: int) -> nn.Module:
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.experts = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, num_shared_experts=num_shared)
    return model


def separate_model(num_shared: int) -> nn.Module:
    """The layout before the fusion: routed FusedMoE, shared experts a GatedMLP."""
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.experts = FusedMoE(NUM_EXPERTS, HIDDEN, INTER)
    model.mlp.shared_experts = GatedMLP(HIDDEN, num_shared * INTER)
    return model


def routing(num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(num_tokens)])
    return torch.rand(num_tokens, TOP_K, generator=g) * 2.5, ids


def all_params(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("num_shared", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_shared_experts_match_a_separate_shared_mlp(num_shared, num_tokens):
    weights = checkpoint(num_shared)
    fused, separate = fused_model(num_shared), separate_model(num_shared)
    assert load_hf_moe_weights(fused, weights) == all_params(fused)
    assert load_hf_moe_weights(separate, weights) == all_params(separate)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing(num_tokens)
    got = fused.mlp.experts(x, topk_weights, topk_ids)
    want = separate.mlp.experts(x, topk_weights, topk_ids) + separate.mlp.shared_experts(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The appended slots are constants of the layer, not checkpoint state.
    assert set(fused.state_dict()) == all_params(fused)


def test_shared_tensors_load_into_the_slots_after_the_routed_experts():
    weights = dict(checkpoint(2))
    model = fused_model(2)
    load_hf_moe_weights(model, weights.items())
    w13, w2 = model.mlp.experts.w13_weight, model.mlp.experts.w2_weight
    assert w13.shape == (NUM_EXPERTS + 2, 2 * INTER, HIDDEN)
    for j in range(2):
        chunk = slice(j * INTER, (j + 1) * INTER)
        gate = weights["mlp.shared_experts.gate_proj.weight"][chunk]
        up = weights["mlp.shared_experts.up_proj.weight"][chunk]
        assert torch.equal(w13[NUM_EXPERTS + j], torch.cat((gate, up)))
        down = weights["mlp.shared_experts.down_proj.weight"][:, chunk]
        assert torch.equal(w2[NUM_EXPERTS + j], down)

    # transformers' stacked routed layout fills the routed slots alone; the shared ones
    # still come from the shared MLP's names.
    stacked = fused_model(2)
    names = [(n, t) for n, t in weights.items() if ".experts." not in n]
    names += [
        ("mlp.experts.gate_up_proj", w13[:NUM_EXPERTS].clone()),
        ("mlp.experts.down_proj", w2[:NUM_EXPERTS].clone()),
    ]
    assert load_hf_moe_weights(stacked, names) == all_params(stacked)
    assert torch.equal(stacked.mlp.experts.w13_weight, w13)
    assert torch.equal(stacked.mlp.experts.w2_weight, w2)


@pytest.mark.parametrize(
    "dropped,missing",
    [
        ("mlp.shared_experts.up_proj.weight", "mlp.experts.w13_weight"),
        ("mlp.shared_experts.down_proj.weight", "mlp.experts.w2_weight"),
        ("mlp.experts.3.gate_proj.weight", "mlp.experts.w13_weight"),
    ],
)
def test_a_missing_tensor_leaves_its_stack_unloaded(dropped, missing):
    # The loader compares the returned names with the model's parameters: what is absent
    # here is what it reports as missing.
    model = fused_model(1)
    loaded = load_hf_moe_weights(model, [(n, t) for n, t in checkpoint(1) if n != dropped])
    assert all_params(model) - loaded == {missing}


def test_shared_tensor_of_the_wrong_size_and_out_of_range_experts_are_errors():
    weights = dict(checkpoint(1))
    gate_name = "mlp.shared_experts.gate_proj.weight"
    one_shared = (gate_name, weights[gate_name])
    with pytest.raises(ValueError, match="2 shared experts"):
        load_hf_moe_weights(fused_model(2), [one_shared])
    gate = weights["mlp.experts.0.gate_proj.weight"]
    with pytest.raises(ValueError, match="6 routed experts"):  # not a back door into a shared slot
        load_hf_moe_weights(fused_model(1), [(f"mlp.experts.{NUM_EXPERTS}.gate_proj.weight", gate)])


def test_tensor_parallel_slices_sum_to_the_whole(monkeypatch):
    weights = checkpoint(2)
    whole = fused_model(2)
    load_hf_moe_weights(whole, weights)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    topk_weights, topk_ids = routing(5)
    total = torch.zeros_like(x)
    for rank in range(2):
        monkeypatch.setattr(moe_module, "tensor_parallel",
                            lambda rank=rank: TensorParallel(rank, 2, None))
        part = fused_model(2)
        assert part.mlp.experts.w13_weight.shape == (NUM_EXPERTS + 2, INTER, HIDDEN)
        load_hf_moe_weights(part, weights)
        total += part.mlp.experts(x, topk_weights, topk_ids)  # what the all-reduce sums
    expected = whole.mlp.experts(x, topk_weights, topk_ids)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_expert_parallel_ranks_hold_whole_experts_and_sum_to_the_whole(monkeypatch):
    weights = checkpoint(2)
    whole = fused_model(2)
    load_hf_moe_weights(whole, weights)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    topk_weights, topk_ids = routing(5)
    total = torch.zeros_like(x)
    for rank in range(2):
        monkeypatch.setattr(moe_module, "tensor_parallel",
                            lambda rank=rank: TensorParallel(rank, 2, None, expert_parallel=True))
        part = fused_model(2)
        # half the routed experts and one of the two shared ones, each whole
        assert part.mlp.experts.w13_weight.shape == (NUM_EXPERTS // 2 + 1, 2 * INTER, HIDDEN)
        assert set(load_hf_moe_weights(part, weights)) >= {"mlp.experts.w13_weight",
                                                          "mlp.experts.w2_weight"}
        total += part.mlp.experts(x, topk_weights, topk_ids)
    expected = whole.mlp.experts(x, topk_weights, topk_ids)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
