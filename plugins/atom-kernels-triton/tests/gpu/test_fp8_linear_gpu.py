"""The Triton ``linear`` op with an ``Fp8Weight`` on the GPU, at Qwen3-8B's projections,
against ``atom_core.quant.fp8.fp8_linear``: every path by its rows (the fp8 GEMV up to
gemv_config.MAX_ROWS, the weight-only GEMM below ``w8a8_min_rows``, the W8A8 GEMM from
there on), bf16 and fp16, with a bias; the fused forms at one row; DeferredNorm inputs;
split-K determinism and CUDA-graph replay; the quantization kernel bit for bit against
``quantize_rows`` on the GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from atom_kernels_triton import fp8_gemm, gemv  # noqa: E402
from atom_kernels_triton.fp8_quant import quantize_rows  # noqa: E402
from atom_kernels_triton.gemv import linear, rms_norm_linear, silu_and_mul_linear  # noqa: E402
from atom_kernels_triton.gemv_config import MAX_ROWS  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.deferred_norm import DeferredNorm, normed  # noqa: E402
from atom_core.ops.native import norm as native_norm  # noqa: E402
from atom_core.ops.native.activation import (  # noqa: E402
    silu_and_mul_linear as native_silu_and_mul_linear,
)
from atom_core.ops.native.linear import rms_norm_linear as native_rms_norm_linear  # noqa: E402
from atom_core.quant import fp8  # noqa: E402
from atom_core.quant.fp8 import Fp8Weight, fp8_linear, quantize_weight, uses_w8a8  # noqa: E402

# (N, K) of Qwen3-8B's decoder projections.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = [1, 4, 16, 32, 64, 200, 256, 512, 2048]
EPS = 1e-6
_weights: dict = {}


def weight(n: int, k: int) -> Fp8Weight:
    if (n, k) not in _weights:
        _weights.clear()
        g = torch.Generator(device="cuda").manual_seed(0)
        _weights[(n, k)] = quantize_weight(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    return _weights[(n, k)]


def rand(*shape, dtype=torch.bfloat16, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def path(m: int, w: Fp8Weight) -> str:
    x = torch.empty(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
    if gemv.supported(x, w, None):
        return "gemv"
    return "w8a8" if uses_w8a8(x, w) else "gemm"


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_path_matches_fp8_linear(shape, m):
    w = weight(*SHAPES[shape])
    expected = "gemv" if m <= MAX_ROWS else "gemm" if m < w.w8a8_min_rows else "w8a8"
    assert path(m, w) == expected
    if expected == "w8a8":
        assert fp8_gemm.w8a8_ok(rand(m, w.shape[1]), w, None)  # not the reference's fallback
    for dtype in (torch.bfloat16, torch.float16):
        x = rand(m, w.shape[1], dtype=dtype, seed=m)
        b = rand(w.shape[0], dtype=dtype, seed=2)
        out = linear(x, w, b)
        assert out.dtype == dtype and out.shape == (m, w.shape[0])
        # The same e4m3 operands (W8A8: x quantized bit for bit as the reference does), fp32
        # sums in another order, the output rounded.
        assert rel_err(out, fp8_linear(x, w, b)) < tolerance(dtype), (shape, m, dtype)


@pytest.mark.parametrize("shape", ["o", "down"])
def test_scaled_mm_accumulation_error_is_far_below_the_quantization_error(shape):
    # torch._scaled_mm's fast accumulation (fp8_gemm.SCALED_MM_FAST_ACCUM) rounds the sums
    # over K; what justifies it is that this, with the output's bf16 rounding, stays an order
    # of magnitude under what e4m3 rounding of x and W costs any W8A8 product. K 4096 and
    # 12288, prefill rows.
    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(3)
    w_full = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    w = quantize_weight(w_full, w8a8_min_rows=1)
    x = rand(2048, k, seed=4)
    xq, xs = quantize_rows(x)
    assert fp8_gemm.w8a8_table_config(2048, n, k, x.device) is None  # torch._scaled_mm
    out = fp8_gemm.w8a8_matmul(xq, xs, w, None, torch.bfloat16)  # row-wise: bf16 out only
    exact = fp8.w8a8_matmul(xq, xs, w, None, torch.float32)
    accumulation = rel_err(out, exact)
    quantization = rel_err(exact, x.float() @ w_full.T)
    assert accumulation < 0.1 * quantization, (accumulation, quantization)


@pytest.mark.parametrize("m", [1, 4, 17, 32, 64, 65, 128, 129])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_w8a8_at_every_row_count(shape, m):
    # W8A8 from one row (--fp8-w8a8-min-rows 1), as the device's table routes it, and the
    # Triton GEMM on e4m3 operands with the shape heuristic's tiles and with a few others.
    q = weight(*SHAPES[shape])
    w = Fp8Weight(q.qweight, q.scale, 1)
    n, k = w.shape
    tiles = [fp8_gemm.w8a8_config(m, n, k)]
    tiles += [fp8_gemm.GemmConfig(BLOCK_M=fp8_gemm.m_bucket(min(m, 64)), BLOCK_N=bn,
                                  BLOCK_K=bk, SPLIT_K=2, SWAP=swap, num_warps=4, num_stages=3)
              for bn, bk, swap in [(128, 128, True), (64, 512, False)]]
    for dtype in (torch.bfloat16, torch.float16):
        x = rand(m, k, dtype=dtype, seed=m)
        b = rand(n, dtype=dtype, seed=2)
        ref = fp8_linear(x, w, b)
        out = linear(x, w, b)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, ref) < tolerance(dtype), (shape, m, dtype)
        xq, xs = quantize_rows(x)
        for c in tiles:
            out = fp8_gemm.w8a8_matmul(xq, xs, w, b, dtype, config=c)
            assert rel_err(out, ref) < tolerance(dtype), (shape, m, dtype, c)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_split_k_paths_are_deterministic_and_replay_in_a_graph(shape):
    w = weight(*SHAPES[shape])
    xs = [rand(m, w.shape[1], seed=m) for m in (1, 4, 32, 256)]
    eager = [linear(x, w) for x in xs]
    assert all(torch.equal(a, linear(x, w)) for a, x in zip(eager, xs))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in xs:
            linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear(x, w) for x in xs]
    for x, s in zip(xs, (3, 5, 7, 9)):
        x.copy_(rand(*x.shape, seed=s))
    graph.replay()
    torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        assert torch.equal(out, linear(x, w))


def test_silu_and_mul_linear_one_row():
    w = weight(*SHAPES["down"])
    for dtype in (torch.bfloat16, torch.float16):
        x = rand(1, 2 * w.shape[1], dtype=dtype, seed=3)
        out = silu_and_mul_linear(x, w)
        assert rel_err(out, native_silu_and_mul_linear(x, w)) < tolerance(dtype)


@pytest.mark.parametrize("shape", ["qkv", "gate_up"])
def test_rms_norm_linear_one_row(shape):
    w = weight(*SHAPES[shape])
    k = w.shape[1]
    x, res = rand(1, k, seed=3), rand(1, k, seed=4)
    nw = (1 + 0.1 * rand(k, dtype=torch.float32, seed=5)).bfloat16()
    out, summed = rms_norm_linear(x, res, nw, EPS, w)
    ref_out, ref_summed = native_rms_norm_linear(x, res, nw, EPS, w)
    assert torch.equal(summed, ref_summed)
    assert rel_err(out, ref_out) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 4, 64, 256])
def test_deferred_norm_inputs(m):
    w = weight(*SHAPES["qkv"])
    k = w.shape[1]
    h, nw = rand(m, k, seed=6), (1 + 0.1 * rand(k, dtype=torch.float32, seed=5)).bfloat16()
    hf = h.float()
    sumsq = torch.stack([c.pow(2).sum(-1) for c in hf.chunk(4, dim=-1)])
    d = DeferredNorm(h, (hf * nw.float()).bfloat16(), sumsq, nw, EPS)
    ref = fp8_linear(normed(d, native_norm.rms_norm), w)
    assert rel_err(linear(d, w), ref) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("m,k", [(1, 4096), (256, 4096), (2048, 4096), (7, 12288), (3, 20000)])
def test_quantize_rows_is_bitwise_the_reference(m, k):
    x = rand(m, k, seed=m) * torch.logspace(-3, 3, m, device="cuda")[:, None].bfloat16()
    q, scale = quantize_rows(x)
    ref_q, ref_scale = fp8.quantize_rows(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
