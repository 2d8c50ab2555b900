"""The ``rms_norm_quant_fp8`` op's reference (RMSNorm, after an optional residual add, and
per-row fp8 quantization in one op) and the ``rms_norm_linear`` reference that uses it on
the W8A8 path: the norm's fp32 rows quantized by ``quantize_rows`` with no rounding to the
model dtype between; fewer rows than ``w8a8_min_rows`` keep the two ops."""

from __future__ import annotations

import pytest
import torch

from atom_core.ops import resolve_op
from atom_core.ops.native import norm as native_norm
from atom_core.ops.native.linear import rms_norm_linear
from atom_core.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    fp8_linear,
    quantize_rows,
    quantize_weight,
)

EPS = 1e-6


def inputs(m: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    res = torch.randn(m, k, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    return x, res, w


def exact_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hd = h.double()
    return hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def test_registered():
    assert resolve_op("rms_norm_quant_fp8", "cpu") is native_norm.rms_norm_quant_fp8


@pytest.mark.parametrize("residual", [False, True])
def test_fp32_rows_are_the_norm_then_quantize_rows(residual):
    # In fp32 the norm's output is its fp32 rows: the op is the two ops bit for bit.
    x, res, w = inputs(5, 200, torch.float32)
    r = res if residual else None
    q, scale, summed = native_norm.rms_norm_quant_fp8(x, r, w, EPS)
    if residual:
        normed, want_summed = native_norm.fused_add_rms_norm(x, res, w, EPS)
        assert torch.equal(summed, want_summed)
    else:
        normed = native_norm.rms_norm(x, w, EPS)
        assert summed is x
    ref_q, ref_scale = quantize_rows(normed)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and scale.shape == (5,)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_skip_the_models_rounding(dtype):
    # Hidden 300 (not a power of two), a residual, one row of zeros.
    x, res, w = inputs(6, 300, dtype, seed=1)
    x[2], res[2] = 0.0, -0.0
    q, scale, summed = native_norm.rms_norm_quant_fp8(x, res, w, EPS)
    _, want_summed = native_norm.fused_add_rms_norm(x, res, w, EPS)
    assert torch.equal(summed, want_summed)
    assert summed.dtype == dtype
    # The quantized rows of the fp32 norm, not of its rounded copy.
    normed32 = exact_norm(summed, w).float()
    ref_q, ref_scale = quantize_rows(normed32)
    assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0)
    assert (q.float() == ref_q.float()).float().mean() > 0.99
    # The zero row: the smallest scale, and zeros signed as the norm's (the weight's sign).
    assert scale[2] == MIN_SCALE and q[2].float().eq(0).all()
    assert torch.equal(q[2].view(torch.uint8), ref_q[2].view(torch.uint8))
    # Each row's peak maps to 448, and each value is within e4m3's step of the exact norm.
    live = [i for i in range(6) if i != 2]
    assert q[live].float().abs().amax(-1).eq(FP8_MAX).all()
    exact = exact_norm(summed, w)
    back = q.double() * scale.double()[:, None]
    assert ((back - exact).abs() <= exact.abs() / 16 + scale.double()[:, None] / 64).all()


def test_leading_dims_and_no_rows():
    x, res, w = inputs(6, 64, torch.bfloat16, seed=2)
    q, scale, summed = native_norm.rms_norm_quant_fp8(x.view(2, 3, 64), res.view(2, 3, 64), w,
                                                      EPS)
    flat = native_norm.rms_norm_quant_fp8(x, res, w, EPS)
    assert q.shape == (2, 3, 64) and scale.shape == (2, 3) and summed.shape == (2, 3, 64)
    assert torch.equal(q.view(6, 64).view(torch.uint8), flat[0].view(torch.uint8))
    assert torch.equal(scale.view(6), flat[1])
    q, scale, summed = native_norm.rms_norm_quant_fp8(x[:0], None, w, EPS)
    assert q.shape == (0, 64) and scale.shape == (0,)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_linear_quantizes_the_norms_rows_on_the_w8a8_path(residual, monkeypatch):
    g = torch.Generator().manual_seed(3)
    weight = quantize_weight(torch.randn(48, 96, generator=g) / 10, w8a8_min_rows=4)
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    x, res, w = inputs(4, 96, torch.bfloat16, seed=4)
    r = res if residual else None
    calls = []
    fused = native_norm.rms_norm_quant_fp8
    monkeypatch.setattr("atom_core.ops.native.linear.rms_norm_quant_fp8",
                        lambda *a: calls.append(a[0].shape) or fused(*a))
    out, summed = rms_norm_linear(x, r, w, EPS, weight, bias)
    assert calls == [(4, 96)]
    xq, x_scale, want_summed = fused(x, r, w, EPS)
    want = ((xq.float() * x_scale[:, None]) @ weight.dequantize().T + bias.float())
    assert out.dtype == torch.bfloat16 and torch.equal(summed, want_summed)
    assert torch.allclose(out.float(), want, rtol=1e-2, atol=1e-2)
    # The same product as the two ops, up to the rounding the fused op leaves out.
    normed = (native_norm.fused_add_rms_norm(x, res, w, EPS)[0] if residual
              else native_norm.rms_norm(x, w, EPS))
    two_ops = fp8_linear(normed, weight, bias).float()
    assert ((out.float() - two_ops).norm() / two_ops.norm()) < 0.02
    # In fp32 the two are one computation.
    x32, r32, w32 = x.float(), (r.float() if residual else None), w.float()
    out32, _ = rms_norm_linear(x32, r32, w32, EPS, weight, bias.float())
    normed32 = (native_norm.fused_add_rms_norm(x32, r32, w32, EPS)[0] if residual
                else native_norm.rms_norm(x32, w32, EPS))
    assert torch.equal(out32, fp8_linear(normed32, weight, bias.float()))
    # Fewer rows than w8a8_min_rows: the norm in the model dtype, then the weight-only product.
    calls.clear()
    out3, summed3 = rms_norm_linear(x[:3], r[:3] if residual else None, w, EPS, weight, bias)
    assert not calls
    normed3 = normed[:3]
    assert torch.equal(out3, fp8_linear(normed3, weight, bias))
    assert torch.equal(summed3, summed[:3])
