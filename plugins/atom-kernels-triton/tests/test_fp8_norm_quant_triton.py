"""The Triton ``rms_norm_quant_fp8`` (RMSNorm after an optional residual add, quantized per
row to e4m3 in the same kernel) against the native op, and ``rms_norm_linear``'s W8A8 path
built on it, on CPU through TRITON_INTERPRET=1: bit for bit where the sum of squares is
exact in any order, else within the sum's rounding (scales within a few fp32 ulps, a rare
value one e4m3 step off); hidden sizes off a power of two, one tile and three passes, rows
of zeros and signed zeros. The interpreter rounds fp32 to bf16 by truncation, so the
residual sum is checked in fp16 and fp32 here, in bf16 by tests/gpu/test_fp8_norm_quant_gpu.py.
Skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import fp8_norm_quant, gemv, hooks  # noqa: E402
from atom_kernels_triton.fp8_norm_quant import rms_norm_quant_fp8  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.config import Config  # noqa: E402
from atom_core.loader import load_model  # noqa: E402
from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native import linear as native_linear  # noqa: E402
from atom_core.ops.native import norm as native_norm  # noqa: E402
from atom_core.plugins import reset_plugins  # noqa: E402
from atom_core.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_weight  # noqa: E402
from atom_core.testing.tensor_parallel import step_logits  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# (rows, hidden, dtype): hidden sizes off a power of two, and one that is one.
CASES = [(1, 64, torch.float16), (5, 300, torch.float16), (3, 1000, torch.float32)]
IDS = [f"{m}x{k}-{str(d)[6:]}" for m, k, d in CASES]


def inputs(m: int, k: int, dtype: torch.dtype, seed: int = 0, exact: bool = False):
    """(x, residual, norm weight), a row of zeros, a run of signed zeros and a weight with
    negative entries. ``exact``: values k/8 in [-2, 2], whose squares sum exactly in fp32
    in any order (for K up to 16384), so the kernel's rsqrt is the reference's."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        x = torch.randint(-16, 17, (m, k), generator=g) / 8
        res = torch.randint(-16, 17, (m, k), generator=g) / 8
    else:
        x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
        res = torch.randn(m, k, generator=g)
    if m > 1:
        x[1], res[1] = 0.0, 0.0
    x[-1, : k // 4], res[-1, : k // 4] = -0.0, -0.0
    w = torch.randn(k, generator=g)
    return x.to(dtype).to(DEVICE), res.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).to(torch.int16)


def assert_matches(got, want, bitwise: bool) -> None:
    (q, scale, summed), (ref_q, ref_scale, ref_summed) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == ref_q.shape
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape
    assert torch.equal(summed, ref_summed)
    if bitwise:
        assert torch.equal(scale, ref_scale)
        assert torch.equal(codes(q), codes(ref_q))  # signed zeros too
        return
    assert torch.allclose(scale, ref_scale, rtol=5e-7, atol=0)
    a, b = codes(q), codes(ref_q)
    assert torch.equal(a >> 7, b >> 7)  # the signs, zeros' included
    steps = ((a & 0x7F) - (b & 0x7F)).abs()
    assert steps.max() <= 1 and steps.float().mean() < 0.01


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("block_k", [None, 64], ids=["one-tile", "three-pass"])
def test_bitwise_where_the_sum_of_squares_is_exact(case, residual, block_k):
    x, res, w = inputs(*case, exact=True)
    r = res if residual else None
    got = rms_norm_quant_fp8(x, r, w, EPS, block_k)
    assert_matches(got, native_norm.rms_norm_quant_fp8(x, r, w, EPS), bitwise=True)
    if not residual:
        assert got[2] is x
    if case[0] > 1:  # the zero row: the smallest scale
        assert got[1][1] == MIN_SCALE and got[0][1].float().eq(0).all()
    assert (got[0][0].float().abs().amax() == FP8_MAX) and (codes(got[0]) == 0x80).any()


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_random_rows_within_the_sums_rounding(case, residual):
    x, res, w = inputs(*case, seed=1)
    r = res if residual else None
    for block_k in (None, 128):
        got = rms_norm_quant_fp8(x, r, w, EPS, block_k)
        assert_matches(got, native_norm.rms_norm_quant_fp8(x, r, w, EPS), bitwise=False)


def test_bf16_rows_without_a_residual():
    x, _, w = inputs(4, 300, torch.bfloat16, exact=True)
    assert_matches(rms_norm_quant_fp8(x, None, w, EPS),
                   native_norm.rms_norm_quant_fp8(x, None, w, EPS), bitwise=True)


def test_leading_dims_strided_rows_and_what_the_kernel_does_not_take():
    x, res, w = inputs(6, 200, torch.float16, exact=True)
    wide = torch.zeros(6, 400, dtype=torch.float16, device=DEVICE)
    wide[:, :200] = x
    got = rms_norm_quant_fp8(wide[:, :200].view(2, 3, 200), res.view(2, 3, 200), w, EPS)
    assert got[0].shape == (2, 3, 200) and got[1].shape == (2, 3)
    assert_matches(tuple(t.reshape(6, -1).squeeze(-1) for t in got),
                   native_norm.rms_norm_quant_fp8(x, res, w, EPS), bitwise=True)
    empty = rms_norm_quant_fp8(x[:0], None, w, EPS)
    assert empty[0].shape == (0, 200) and empty[1].shape == (0,)
    # A residual in another dtype: the native op's answer.
    assert not fp8_norm_quant.takes(x, res.float(), w)
    assert_matches(rms_norm_quant_fp8(x, res.float(), w, EPS),
                   native_norm.rms_norm_quant_fp8(x, res.float(), w, EPS), bitwise=True)


def test_registered():
    assert hooks.triton_ops()["rms_norm_quant_fp8"] is rms_norm_quant_fp8
    assert resolve_op("rms_norm_quant_fp8", "cpu") is native_norm.rms_norm_quant_fp8


class Counted:
    """Stands in for a kernel: runs it, counting launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_rms_norm_linear_w8a8_path(residual, monkeypatch):
    # From w8a8_min_rows the rows are normed and quantized by one kernel, then multiplied
    # by the W8A8 GEMM; below it, as before.
    kernel = Counted(fp8_norm_quant._rms_norm_quant_kernel)
    monkeypatch.setattr(fp8_norm_quant, "_rms_norm_quant_kernel", kernel)
    weight = quantize_weight(torch.randn(48, 96, device=DEVICE) / 10, w8a8_min_rows=20)
    bias = torch.randn(48, device=DEVICE).half()
    x, res, w = inputs(20, 96, torch.float16, seed=2)
    r = res if residual else None
    out, summed = gemv.rms_norm_linear(x, r, w, EPS, weight, bias)
    ref_out, ref_summed = native_linear.rms_norm_linear(x, r, w, EPS, weight, bias)
    assert kernel.launches == 1
    assert out.shape == (20, 48) and out.dtype == torch.float16
    assert torch.equal(summed, ref_summed)
    assert rel_err(out, ref_out) < tolerance(torch.float16)
    out3d, _ = gemv.rms_norm_linear(x.view(4, 5, 96), r.view(4, 5, 96) if residual else None,
                                    w, EPS, weight, bias)
    assert kernel.launches == 2 and torch.equal(out3d.view(20, 48), out)
    few, few_summed = gemv.rms_norm_linear(x[:19], r[:19] if residual else None, w, EPS,
                                           weight, bias)
    assert kernel.launches == 2
    want, want_summed = native_linear.rms_norm_linear(x[:19], r[:19] if residual else None, w,
                                                      EPS, weight, bias)
    assert torch.equal(few_summed, want_summed)
    assert rel_err(few, want) < tolerance(torch.float16)


STEPS = [[[5, 9, 3, 7, 1], [11, 2, 8], [4, 4, 6, 10, 12, 14]],
         [[13], [17], [19, 21, 23, 25]]]


def _logits(kind: str, dtype: torch.dtype, fuse: bool) -> list[torch.Tensor]:
    config = Config.from_kwargs(model=str(tiny_model_dir(kind)), quantization="fp8",
                                fp8_w8a8_min_rows=1)
    return step_logits(load_model(config, "cpu", dtype, fuse=fuse).model, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_model_logits_with_the_kernel_equal_the_unfused_models(kind, monkeypatch):
    """A tiny model under --quantization fp8 with W8A8 at every size, the Triton
    ``rms_norm_linear`` (so this kernel) serving its fused norms and the native ops the
    rest, against the unfused model (norm, then the product quantizing its input): in
    fp32 the kernel differs from the two ops only by its sum of squares' order."""
    want = _logits(kind, torch.float32, fuse=False)
    kernel = Counted(fp8_norm_quant._rms_norm_quant_kernel)
    monkeypatch.setattr(fp8_norm_quant, "_rms_norm_quant_kernel", kernel)
    monkeypatch.setattr(hooks, "unavailable_reason", lambda: None)
    monkeypatch.setattr(hooks, "DEVICE_KINDS", ("cpu", "cuda", "hip"))
    monkeypatch.setattr(hooks, "triton_ops", lambda: {"rms_norm_linear": gemv.rms_norm_linear})
    monkeypatch.setattr(hooks, "attention_backends", lambda: {})
    reset_plugins()
    try:
        got = _logits(kind, torch.float32, fuse=True)
    finally:
        reset_plugins()
    layers = 2 if kind == "llama" else 3
    assert kernel.launches == 2 * layers * len(STEPS)
    for g, w in zip(got, want):
        assert (g - w).norm() / w.norm() < 1e-3
        assert torch.equal(g.argmax(-1), w.argmax(-1))
