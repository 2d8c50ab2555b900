"""FP8 experts: the native fused_moe with ``Fp8Weight`` stacks against a token-by-token loop
over the dequantized weights, in both formats (weight-only below ``w8a8_min_rows`` tokens,
W8A8 from there on), shared experts included; and ``FusedMoE.quantize_fp8``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atom_core.layers.moe import FusedMoE, load_hf_moe_weights
from atom_core.ops.native.moe import fused_moe
from atom_core.quant.fp8 import FP8_DTYPE, Fp8Weight, quantize_weight
from atom_core.testing.op_cases import moe_checkpoint

E4M3_MAX = 448.0
SMALLEST_SCALE = 1.0 / (448.0 * 512.0)


def fake_quant_row(v: torch.Tensor) -> torch.Tensor:
    """v [K] fp32 through e4m3 with one scale for the row: the largest magnitude maps to 448."""
    scale = max(float(v.abs().max()) / E4M3_MAX, SMALLEST_SCALE)
    return (v / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).float() * scale


def reference(x, w13: Fp8Weight, w2: Fp8Weight, weights, ids, w8a8: bool):
    """Each token's experts one at a time, over weights dequantized as qweight * scale; the
    model-dtype roundings where a bf16 model has them (gate_up, silu, product, expert out)."""
    dtype, inter = x.dtype, w13.shape[1] // 2
    d13 = w13.qweight.float() * w13.scale[..., None]
    d2 = w2.qweight.float() * w2.scale[..., None]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xt = fake_quant_row(x[t].float()) if w8a8 else x[t].float()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < d13.shape[0]:
                continue
            h = (d13[e] @ xt).to(dtype)
            act = (F.silu(h[:inter]) * h[inter:]).float()
            a = fake_quant_row(act) if w8a8 else act
            out[t] += float(weights[t, j]) * (d2[e] @ a).to(dtype).float()
    return out.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def fp8_experts(experts, hidden, inter, min_rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return quantize_weight(w13, min_rows), quantize_weight(w2, min_rows)


def routing(tokens, routed, top_k, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(routed, generator=g)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g), ids


# fp32: the two sides differ by fp32 sum order (measured 3e-7), and in W8A8 by the rare
# element whose e4m3 rounding that order flips; bf16: by a bf16 rounding that order flips
# (measured: none, bitwise equal).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("shared", [0, 2])
def test_native_fp8_matches_dequantized_loop(dtype, w8a8, shared):
    tokens, routed, top_k, hidden, inter = 13, 6, 3, 48, 20
    # The step's 13 tokens, not an expert's share of them, pick the format.
    w13, w2 = fp8_experts(routed + shared, hidden, inter, 13 if w8a8 else 14)
    weights, ids = routing(tokens, routed, top_k)
    ids[2, 1], ids[5, 0] = -1, routed + shared  # another rank's expert: skipped
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared)
    assert got.dtype == dtype and got.shape == x.shape
    # The shared experts: the last ``shared`` of the stack, taken by every token at weight 1.
    full_ids = torch.cat((ids, torch.arange(routed, routed + shared).expand(tokens, -1)), 1)
    full_weights = torch.cat((weights, torch.ones(tokens, shared)), 1)
    want = reference(x, w13, w2, full_weights, full_ids, w8a8)
    assert rel_err(got, want) < TOLERANCE[dtype]
    # The other format is off by the activations' e4m3 rounding (about 4%): the test tells
    # the two apart.
    other = reference(x, w13, w2, full_weights, full_ids, not w8a8)
    assert rel_err(got, other) > 0.02


def test_native_fp8_equals_the_dequantized_weight_in_fp32():
    # Weight-only with an fp32 model: the product is the dequantized weight's, up to fp32 sums.
    w13, w2 = fp8_experts(5, 32, 16, min_rows=1000)
    weights, ids = routing(9, 5, 2)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    got = fused_moe(x, w13, w2, weights, ids)
    want = fused_moe(x, w13.dequantize(), w2.dequantize(), weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


NUM_EXPERTS, HIDDEN, INTER, SHARED, TOP_K = 6, 64, 32, 2, 2


def bf16_layer() -> FusedMoE:
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.experts = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, num_shared_experts=SHARED)
    load_hf_moe_weights(model, moe_checkpoint(NUM_EXPERTS, HIDDEN, INTER, SHARED))
    return model.mlp.experts.to(torch.bfloat16)


# e4m3 keeps 3 mantissa bits: each weight is off by up to 1/16 of itself (about 2.5% rms
# over a Gaussian's values), in each of the two products; W8A8 adds the activations'
# rounding. Measured over seeds: 4-5% weight-only, 5.5-6.5% W8A8; bounded with margin.
WEIGHT_ONLY_BOUND, W8A8_BOUND = 0.07, 0.09


@pytest.mark.parametrize("tokens", [5, 40])  # below and from w8a8_min_rows = 16
def test_quantized_layer_is_close_to_the_bf16_layer(tokens):
    layer = bf16_layer()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    weights, ids = routing(tokens, NUM_EXPERTS, TOP_K, seed=tokens)
    before = layer(x, weights * 2.5, ids)
    w13, w2 = layer.w13_weight.data.clone(), layer.w2_weight.data.clone()
    layer.quantize_fp8(16)
    after = layer(x, weights * 2.5, ids)
    assert after.dtype == torch.bfloat16
    assert rel_err(after, before) < (W8A8_BOUND if tokens >= 16 else WEIGHT_ONLY_BOUND)
    # The layer hands the op its stacks as quantize_weight makes them, shared experts
    # included; the same output as the op given those directly.
    want13, want2 = quantize_weight(w13, 16), quantize_weight(w2, 16)
    assert torch.equal(after, fused_moe(x, want13, want2, weights * 2.5, ids,
                                        num_shared_experts=SHARED))


def test_quantize_fp8_replaces_the_parameters():
    layer = bf16_layer()
    w13 = layer.w13_weight.data.clone()
    old = weakref.ref(layer.w13_weight), weakref.ref(layer.w2_weight)
    layer.quantize_fp8(64)
    gc.collect()
    assert old[0]() is None and old[1]() is None  # the bf16 stacks are not kept
    params = dict(layer.named_parameters())
    assert set(params) == {"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"}
    total = NUM_EXPERTS + SHARED
    assert params["w13_weight"].dtype == params["w2_weight"].dtype == FP8_DTYPE
    assert params["w13_weight"].shape == (total, 2 * INTER, HIDDEN)
    assert params["w2_weight"].shape == (total, HIDDEN, INTER)
    assert params["w13_weight_scale"].dtype == torch.float32
    assert params["w13_weight_scale"].shape == (total, 2 * INTER)
    assert params["w2_weight_scale"].shape == (total, HIDDEN)
    assert not any(p.requires_grad for p in params.values())
    want = quantize_weight(w13)
    assert torch.equal(layer.w13_weight.view(torch.uint8), want.qweight.view(torch.uint8))
    assert torch.equal(layer.w13_weight_scale, want.scale)
    assert "fp8" in repr(layer)


def test_forward_passes_the_stored_fp8_weights():
    layer = bf16_layer()
    layer.quantize_fp8(64)
    w13, w2 = layer.fp8
    assert w13.qweight is layer.w13_weight and w13.scale is layer.w13_weight_scale
    assert w2.qweight is layer.w2_weight and w2.scale is layer.w2_weight_scale
    assert w13.w8a8_min_rows == w2.w8a8_min_rows == 64
    seen = []
    layer._op = lambda x, a, b, *args, **kwargs: seen.append((a, b, kwargs)) or x
    weights, ids = routing(3, NUM_EXPERTS, TOP_K)
    for _ in range(2):
        layer(torch.zeros(3, HIDDEN, dtype=torch.bfloat16), weights, ids)
    assert all(a is w13 and b is w2 for a, b, _ in seen)  # built once, not per call
    assert seen[0][2]["num_shared_experts"] == SHARED
