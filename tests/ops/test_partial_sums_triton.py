"""``linear_unreduced`` (a split-K product left as ``PartialSums``) and
``add_rms_norm_partials`` (their sum folded into the residual add + RMSNorm), Triton
against the native ops and against the two-kernel path they replace, on CPU through
TRITON_INTERPRET=1 (tests/gpu/test_gemv_gpu.py runs the real shapes). Skipped where
triton is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native import linear as native_linear  # noqa: E402
from atom_core.ops.native import norm as native_norm  # noqa: E402
from atom_core.ops.partial_sums import PartialSums  # noqa: E402
from atom_core.ops.triton import gemv, norm  # noqa: E402
from atom_core.ops.triton.activation import silu_and_mul  # noqa: E402
from atom_core.ops.triton.gemv_config import GemvConfig  # noqa: E402
from atom_core.ops.triton.plugin import triton_ops  # noqa: E402
from tests.ops.reference import rel_err, tolerance  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 70, 200  # off every block size
SMALL = GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
SPLIT = GemvConfig(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def dtypes_for(m: int) -> list[torch.dtype]:
    # The interpreter's tl.dot reads bf16 operands as raw bits (test_gemv_triton.py).
    if m > 1 and DEVICE == "cpu":
        return [torch.float32, torch.float16]
    return [torch.float32, torch.float16, torch.bfloat16]


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise, except a bf16 pair on the interpreter, whose casts to bf16 do not round as
    torch's do (it is bitwise on a GPU): there, to bf16 rounding."""
    if DEVICE == "cpu" and got.dtype == torch.bfloat16:
        return rel_err(got, want) < tolerance(torch.bfloat16)
    return torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_a_split_product_comes_back_as_its_partials(m, has_bias):
    for dtype in dtypes_for(m):
        x, w = rand(m, K, dtype=dtype), rand(N, K, dtype=dtype, seed=1)
        b = rand(N, dtype=dtype, seed=2) if has_bias else None
        got = gemv.linear_unreduced(x, w, b, config=SPLIT)
        assert isinstance(got, PartialSums)
        assert got.parts.shape == (3, m, N) and got.parts.dtype == torch.float32
        assert got.dtype == dtype and got.shape == (m, N)
        # Summed, exactly what the split-K reduce kernel makes of the same partials.
        assert same(got.reduce(), gemv.linear(x, w, b, config=SPLIT))


def test_partials_keep_the_leading_dimensions():
    x, w = rand(2, 3, K), rand(N, K, seed=1)
    got = gemv.linear_unreduced(x, w, config=SPLIT)
    assert got.shape == (2, 3, N) and got.reduce().shape == (2, 3, N)
    assert torch.equal(got.reduce(), gemv.linear(x, w, config=SPLIT))


def test_no_split_and_cublas_give_the_tensor(monkeypatch):
    x, w, b = rand(3, K), rand(N, K, seed=1), rand(N, seed=2)
    got = gemv.linear_unreduced(x, w, b, config=SMALL)
    assert isinstance(got, torch.Tensor) and torch.equal(got, gemv.linear(x, w, b, config=SMALL))
    monkeypatch.setattr(gemv, "get_config", lambda *args: None)  # the table says cuBLAS
    got = gemv.linear_unreduced(x, w, b)
    assert isinstance(got, torch.Tensor) and torch.equal(got, native_linear.linear(x, w, b))
    too_many = rand(gemv.WIDE_ROWS + 1, K)  # past every GEMV path: F.linear
    assert torch.equal(gemv.linear_unreduced(too_many, w), native_linear.linear(too_many, w))


KG = 777  # the gated input is gate | up, 2 * KG wide


@pytest.mark.parametrize("m", [1, 3])
def test_gated_partials_are_the_activation_then_the_split_product(m):
    x, w, b = rand(m, 2 * KG), rand(N, KG, seed=1), rand(N, seed=2)
    config = GemvConfig(BLOCK_N=16, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=2)
    got = gemv.linear_unreduced(x, w, b, gated=True, config=config)
    assert isinstance(got, PartialSums) and got.parts.shape[0] == 4
    # One row: the activation inside the GEMV (silu_and_mul_linear); more: its own op first.
    want = gemv.silu_and_mul_linear(x, w, b, config=config) if m == 1 else gemv.linear(
        silu_and_mul(x), w, b, config=config)
    assert torch.equal(got.reduce(), want)
    assert rel_err(got.reduce(), native_linear.linear_unreduced(x, w, b, gated=True)) < tolerance(torch.float32)


def partial_sums(splits: int, m: int, n: int, dtype: torch.dtype, has_bias: bool) -> PartialSums:
    parts = rand(splits, m, n, seed=3)
    bias = rand(n, dtype=dtype, seed=4) if has_bias else None
    return PartialSums(parts, bias, dtype, torch.Size((m, n)))


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("n", [70, 4096])
def test_add_rms_norm_partials_is_the_reduce_then_the_norm(splits, has_bias, has_residual, n):
    m = 3
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        p = partial_sums(splits, m, n, dtype, has_bias)
        residual = rand(m, n, dtype=dtype, seed=5) if has_residual else None
        weight = (1 + 0.1 * rand(n, seed=6)).to(dtype)
        normed, summed = norm.add_rms_norm_partials(p, residual, weight, 1e-6)
        # Bitwise the two kernels it replaces (the reduce, then the Triton norm) ...
        h = p.reduce()
        want_normed, want_summed = (norm.rms_norm(h, weight, 1e-6), h) if residual is None else (
            norm.fused_add_rms_norm(h, residual, weight, 1e-6))
        assert same(summed, want_summed) and same(normed, want_normed)
        # ... and the native op: the same residual stream, the norm to rounding.
        ref_normed, ref_summed = native_norm.add_rms_norm_partials(p, residual, weight, 1e-6)
        assert same(summed, ref_summed)
        assert rel_err(normed, ref_normed) < tolerance(dtype)
        assert normed.dtype == summed.dtype == dtype and normed.shape == summed.shape == (m, n)


def test_add_rms_norm_partials_many_rows_and_3d():
    # Rows past one program's (short rows: several a program), and a [2, 5, N] output.
    p = PartialSums(rand(3, 10, 64, seed=7), None, torch.float32, torch.Size((2, 5, 64)))
    residual, weight = rand(2, 5, 64, seed=8), rand(64, seed=9)
    normed, summed = norm.add_rms_norm_partials(p, residual, weight, 1e-5)
    want_normed, want_summed = norm.fused_add_rms_norm(p.reduce(), residual, weight, 1e-5)
    assert normed.shape == (2, 5, 64)
    assert torch.equal(normed, want_normed) and torch.equal(summed, want_summed)


def test_registered():
    assert resolve_op("linear_unreduced", "cpu") is native_linear.linear_unreduced
    assert resolve_op("add_rms_norm_partials", "cpu") is native_norm.add_rms_norm_partials
    ops = triton_ops()
    assert ops["linear_unreduced"] is gemv.linear_unreduced
    assert ops["add_rms_norm_partials"] is norm.add_rms_norm_partials
