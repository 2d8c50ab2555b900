"""``--quantization fp8``: the format's reference ops against dequantize-then-compute, and
whole tiny models whose logits equal those of the same model holding the dequantized
weights (weight-only), or stay near them with activations quantized too (W8A8)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from atom_core.config import Config
from atom_core.errors import ConfigError
from atom_core.loader import load_model
from atom_core.ops.native import linear as native_linear
from atom_core.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    fp8_linear,
    quantize_rows,
    quantize_weight,
)
from atom_core.testing.tensor_parallel import step_logits
from atom_core.testing.tiny_models import tiny_model_dir


def test_quantize_rows_maps_each_rows_peak_to_448():
    t = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 4.0, -1000.0]])
    q, scale = quantize_rows(t)
    assert q.dtype == FP8_DTYPE
    assert torch.allclose(scale, torch.tensor([2.0 / FP8_MAX, MIN_SCALE, 1000.0 / FP8_MAX]))
    assert q.float().abs().amax(dim=-1).tolist()[::2] == [FP8_MAX, FP8_MAX]
    assert q[1].float().eq(0).all()  # an all-zero row stays zero, no division by zero
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself after the round trip.
    back = q.float() * scale[:, None]
    assert torch.allclose(back, t, rtol=1 / 16, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_below_the_threshold_equals_dequantized_weights(dtype):
    g = torch.Generator().manual_seed(0)
    w = quantize_weight(torch.randn(48, 64, generator=g), w8a8_min_rows=8)
    x = torch.randn(7, 64, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    ref = F.linear(x.float(), w.dequantize(), bias.float())
    got = fp8_linear(x, w, bias)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref, rtol=tol, atol=tol)


def test_w8a8_from_the_threshold_quantizes_each_row():
    g = torch.Generator().manual_seed(1)
    w = quantize_weight(torch.randn(48, 64, generator=g), w8a8_min_rows=8)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-2, 2, 8)[:, None]
    xq, xs = quantize_rows(x)
    ref = F.linear(xq.float() * xs[:, None], w.dequantize())
    got = fp8_linear(x, w)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    # the quantized rows differ from x: the path did quantize (and stays within e4m3's error)
    plain = F.linear(x, w.dequantize())
    assert not torch.equal(got, plain)
    assert ((got - plain).norm() / plain.norm()) < 0.05
    # one row fewer takes the weight-only path
    assert torch.allclose(fp8_linear(x[:7], w), plain[:7], rtol=1e-5, atol=1e-5)


def _quantized_and_reference(kind: str, **quant) -> tuple:
    """(the model quantized online, the same model holding the dequantized weights)."""
    path = str(tiny_model_dir(kind))
    q = load_model(Config.from_kwargs(model=path, quantization="fp8", **quant), "cpu",
                   torch.float32).model
    ref = load_model(Config.from_kwargs(model=path), "cpu", torch.float32).model
    params, quantized = dict(ref.named_parameters()), 0
    for name, scale in q.named_parameters():
        if name.endswith("_scale"):
            weight = name.removesuffix("_scale")
            qweight = dict(q.named_parameters())[weight]
            assert qweight.dtype == FP8_DTYPE
            params[weight].data.copy_(qweight.float() * scale[..., None])
            quantized += 1
    assert quantized > 0
    return q, ref


# a prefill of three prompts, then a mixed step (two decodes and a chunk), then decodes
STEPS = [[[5, 9, 3, 7, 1], [11, 2, 8], [4, 4, 6, 10, 12, 14]],
         [[13], [17], [19, 21, 23, 25]],
         [[27], [29], [31]]]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_weight_only_model_equals_the_model_with_dequantized_weights(kind):
    q, ref = _quantized_and_reference(kind, fp8_w8a8_min_rows=1 << 20)
    for got, want in zip(step_logits(q, STEPS), step_logits(ref, STEPS)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_w8a8_model_stays_near_the_dequantized_model(kind):
    q, ref = _quantized_and_reference(kind, fp8_w8a8_min_rows=1)
    for got, want in zip(step_logits(q, STEPS), step_logits(ref, STEPS)):
        assert not torch.equal(got, want)
        assert ((got - want).norm() / want.norm()).item() < 0.05


def _w8a8_logits(kind: str, dtype: torch.dtype, fuse: bool) -> list[torch.Tensor]:
    path = str(tiny_model_dir(kind))
    config = Config.from_kwargs(model=path, quantization="fp8", fp8_w8a8_min_rows=1)
    return step_logits(load_model(config, "cpu", dtype, fuse=fuse).model, STEPS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_w8a8_norm_and_quantization_fused_keep_the_logits(kind, monkeypatch):
    """The fused decoder's norm and first projection (rms_norm_linear) quantize the norm's
    fp32 rows in one op (rms_norm_quant_fp8); the unfused model norms, rounds to the model
    dtype and quantizes that. In fp32, where that rounding is none, the logits are the
    same bits. In bf16 the fused op skips the rounding, and each e4m3 value it flips
    moves the logits as much as a fresh quantization would: both models are then as near
    the fp32 model as each other (the tiny random models' logits are nearly flat)."""
    fused_calls = []
    fused = native_linear.rms_norm_quant_fp8
    monkeypatch.setattr(native_linear, "rms_norm_quant_fp8",
                        lambda *a: fused_calls.append(1) or fused(*a))
    want = _w8a8_logits(kind, torch.float32, fuse=False)
    assert not fused_calls
    got = _w8a8_logits(kind, torch.float32, fuse=True)
    # Every step, both norms of every layer (the qkv and gate_up projections).
    config = json.loads((tiny_model_dir(kind) / "config.json").read_text())
    assert len(fused_calls) == 2 * config["num_hidden_layers"] * len(STEPS)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if kind != "qwen3":
        return
    half_fused = _w8a8_logits(kind, torch.bfloat16, fuse=True)
    half_unfused = _w8a8_logits(kind, torch.bfloat16, fuse=False)
    for f, u, ref in zip(half_fused, half_unfused, got):
        f, u = f.float(), u.float()
        assert _rel(f, ref) < 0.08 and _rel(u, ref) < 0.08
        assert _rel(f, ref) < 1.25 * _rel(u, ref)


def test_layer_kinds_choose_what_is_quantized():
    path = str(tiny_model_dir("deepseek_v3"))
    m = load_model(Config.from_kwargs(model=path, quantization="fp8", fp8_layers=["attention"]),
                   "cpu", torch.float32).model
    dtypes = {n: p.dtype for n, p in m.named_parameters()}
    assert dtypes["model.layers.0.self_attn.o_proj.weight"] == FP8_DTYPE
    # MLA absorbs kv_b_proj's weight itself: it stays in the model dtype
    assert dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == torch.float32
    assert dtypes["model.layers.0.mlp.gate_up_proj.weight"] == torch.float32
    assert dtypes["lm_head.weight"] == torch.float32
    assert dtypes["model.embed_tokens.weight"] == torch.float32

    # each kind's measured crossover unless --fp8-w8a8-min-rows says otherwise
    moe = load_model(Config.from_kwargs(model=path, quantization="fp8"), "cpu",
                     torch.float32).model
    layer = moe.model.layers[1]
    assert layer.self_attn.o_proj.fp8.w8a8_min_rows == 64
    assert layer.mlp.experts.fp8[0].w8a8_min_rows == 256
    forced = load_model(Config.from_kwargs(model=path, quantization="fp8", fp8_w8a8_min_rows=7),
                        "cpu", torch.float32).model
    assert forced.model.layers[1].mlp.experts.fp8[1].w8a8_min_rows == 7

    tied = load_model(Config.from_kwargs(model=str(tiny_model_dir("llama")), quantization="fp8",
                                         fp8_layers=["lm_head"]), "cpu", torch.float32).model
    assert tied.lm_head.weight.dtype == FP8_DTYPE
    assert tied.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="int4"), "--quantization 'int4' is not one of fp8"),
    (dict(quantization="fp8", fp8_layers=["attention", "norms"]), "'norms' is not one of"),
    (dict(quantization="fp8", fp8_w8a8_min_rows=0), "--fp8-w8a8-min-rows must be >= 1"),
])
def test_bad_quantization_options_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_kwargs(**kwargs)
