"""The Triton router (``moe_route``: the gate's GEMV, then one top-k kernel) vs the native
one, on CPU through TRITON_INTERPRET=1. Skipped where triton is not installed.

Random normal logits have no ties, so both pick the same experts; the kernel lists them
best first and torch.topk(sorted=False) in its own order, so rows are compared sorted by id.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton.gemv import linear, linear_partials  # noqa: E402
from atom_kernels_triton.hooks import triton_ops  # noqa: E402
from atom_kernels_triton.moe_topk import route, select_experts  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native.moe import route as native_route  # noqa: E402
from atom_core.ops.native.moe import select_experts as native_select  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


def check(logits, top_k, *args):
    weights, ids = select_experts(logits, top_k, *args)
    ref_weights, ref_ids = native_select(logits, top_k, *args)
    assert weights.dtype == torch.float32 and ids.dtype == ref_ids.dtype == torch.int64
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    weights, ids = by_id(weights, ids)
    ref_weights, ref_ids = by_id(ref_weights, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def logits(tokens, experts, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g).to(dtype).to(DEVICE)


def bias(experts, seed=1):
    return (0.3 * torch.randn(experts, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


def test_registered():
    assert triton_ops()["moe_route"] is route
    assert resolve_op("moe_route", "cpu") is native_route


def test_partial_logits_are_summed_in_order():
    # [S, T, E] partial sums: the kernel adds them as the split-K reduce would, so the
    # result is select_experts of their in-order sum, bit for bit.
    parts = torch.stack([logits(5, 64, seed=s) for s in range(3)])
    summed = parts[0] + parts[1] + parts[2]
    for args in ((6, "softmax", True), (6, "sigmoid", False, 8, 3, bias(64), 2.5)):
        weights, ids = select_experts(parts, *args)
        ref_weights, ref_ids = select_experts(summed, *args)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_route_matches_native(tokens):
    # Qwen3-30B-A3B's router on a narrow hidden size: an fp32 gate, bf16 hidden states,
    # the GEMV split along K (its partials summed by the top-k kernel) at every size here.
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 1024, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(128, 1024, generator=g) / 32).to(DEVICE)
    parts = linear_partials(x, w)
    assert parts.shape[0] > 1 and torch.equal(sum(parts), linear(x, w))  # in order, from 0
    weights, ids = route(x, w, 8, "softmax", True)
    ref_weights, ref_ids = native_route(x, w, 8, "softmax", True)
    weights, ids = by_id(weights, ids)
    ref_weights, ref_ids = by_id(ref_weights, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@pytest.mark.parametrize("experts", [8, 60, 64, 128])
def test_matches_native(experts, top_k, scoring, renormalize):
    tokens = (1, 5, 33)[(experts + top_k) % 3]
    check(logits(tokens, experts, seed=experts * top_k), top_k, scoring, renormalize)


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_scaling_and_correction_bias(tokens, scoring):
    # The bias moves the choice (here often enough to change it) but not the weights.
    x, b = logits(tokens, 64, seed=tokens), bias(64)
    check(x, 6, scoring, True, None, None, b, 2.5)
    check(x, 6, scoring, False, None, None, b, 16.0)


@pytest.mark.parametrize(
    "experts,top_k,groups,topk_group",
    [(64, 6, 8, 3), (60, 4, 4, 2), (128, 8, 8, 4), (256, 8, 8, 4), (64, 2, 8, 1), (32, 8, 4, 4)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped(experts, top_k, groups, topk_group, with_bias):
    # No bias: a group scores its best expert (V2); with one, its best two (V3).
    b = bias(experts) if with_bias else None
    check(logits(33, experts, seed=experts), top_k, "sigmoid", True, groups, topk_group, b, 2.5)
    check(logits(5, experts, seed=top_k), top_k, "softmax", False, groups, topk_group, b, 1.0)


def test_half_precision_and_strided_logits():
    x = logits(5, 128, dtype=torch.bfloat16)
    check(x, 8, "softmax", True)
    wide = logits(5, 160)
    check(wide[:, 16:144], 8, "sigmoid", False)  # row stride 160, not 128


def test_ties_pick_lowest_index():
    x = torch.zeros(3, 16, device=DEVICE)
    x[1, 9:] = 1.0
    weights, ids = select_experts(x, 4, "softmax", True)
    assert ids.tolist() == [[0, 1, 2, 3], [9, 10, 11, 12], [0, 1, 2, 3]]
    torch.testing.assert_close(weights, torch.full_like(weights, 0.25))


def test_no_tokens():
    weights, ids = select_experts(logits(0, 64), 6, "softmax", True)
    assert weights.shape == ids.shape == (0, 6)


def test_unknown_scoring_function():
    with pytest.raises(ValueError, match="scoring"):
        select_experts(logits(2, 8), 2, "relu")
