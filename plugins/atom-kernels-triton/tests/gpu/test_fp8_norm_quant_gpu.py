"""The Triton ``rms_norm_quant_fp8`` on the GPU against the native op (torch on CUDA): model
widths (Qwen3-30B-A3B's 2048, Qwen3-8B's 4096, DeepSeek-V3's 7168, and a row past one tile),
bf16 and fp16, with and without the residual add: the residual sum bit for bit, the rows bit
for bit where their sum of squares is exact in any order, else within the sum's rounding;
``rms_norm_linear``'s W8A8 path (kernel then ``torch._scaled_mm``) against the native
op's, and its replay in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from atom_kernels_triton import fp8_gemm, fp8_norm_quant  # noqa: E402
from atom_kernels_triton.fp8_norm_quant import rms_norm_quant_fp8  # noqa: E402
from atom_kernels_triton.gemv import rms_norm_linear  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.native.linear import rms_norm_linear as native_rms_norm_linear  # noqa: E402
from atom_core.ops.native.norm import rms_norm_quant_fp8 as native  # noqa: E402
from atom_core.quant.fp8 import FP8_DTYPE, quantize_weight  # noqa: E402

EPS = 1e-6
WIDTHS = [2048, 4096, 7168, 20000]
ROWS = [1, 64, 256, 4096]


def rand(*shape, dtype=torch.bfloat16, seed=1, exact=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if exact:  # k/8 in [-2, 2]: squares sum exactly in fp32 in any order
        return (torch.randint(-16, 17, shape, device="cuda", generator=g) / 8).to(dtype)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).to(torch.int16)


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_matches_the_native_op(k, m, dtype, residual):
    x = rand(m, k, dtype=dtype, seed=m) * torch.logspace(-2, 2, m, device="cuda")[:, None].to(
        dtype)
    x[0, : k // 8] = 0.0
    res = rand(m, k, dtype=dtype, seed=2) if residual else None
    w = (1 + 0.1 * rand(k, dtype=torch.float32, seed=5)).to(dtype)
    q, scale, summed = rms_norm_quant_fp8(x, res, w, EPS)
    ref_q, ref_scale, ref_summed = native(x, res, w, EPS)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k) and scale.shape == (m,)
    assert torch.equal(summed, ref_summed)
    # The sum of squares in another order: 1/rms, and with it the scale, a few ulps off;
    # a value one e4m3 step off where it lies that close to a rounding boundary.
    assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0)
    a, b = codes(q), codes(ref_q)
    assert torch.equal(a >> 7, b >> 7)
    steps = ((a & 0x7F) - (b & 0x7F)).abs()
    assert steps.max() <= 1 and steps.float().mean() < 1e-3


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_bitwise_where_the_sum_of_squares_is_exact(k, residual):
    # torch's CUDA mean (the sum times 1/K) and rsqrt (rsqrtf): the same bits once the sum
    # is. Signed zeros too.
    m = 64
    x = rand(m, k, seed=3, exact=True)
    x[1] = 0.0
    x[2, : k // 4] = -0.0
    res = rand(m, k, seed=4, exact=True) if residual else None
    if residual:
        res[1], res[2, : k // 4] = 0.0, -0.0
    w = rand(k, seed=5)
    q, scale, summed = rms_norm_quant_fp8(x, res, w, EPS)
    ref_q, ref_scale, ref_summed = native(x, res, w, EPS)
    assert torch.equal(summed, ref_summed)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes(q), codes(ref_q))


@pytest.mark.parametrize("m", [64, 256, 2048])
@pytest.mark.parametrize("n,k", [(6144, 4096), (24576, 4096)])
def test_rms_norm_linear_w8a8_path(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = quantize_weight(torch.randn(n, k, device="cuda", generator=g) / k**0.5,
                             w8a8_min_rows=64)
    x, res = rand(m, k, seed=6), rand(m, k, seed=7)
    nw = (1 + 0.1 * rand(k, dtype=torch.float32, seed=5)).bfloat16()
    assert fp8_norm_quant.takes_linear(x, res, nw, weight)
    assert fp8_gemm.w8a8_ok(x, weight, None)  # _scaled_mm, not the reference product
    out, summed = rms_norm_linear(x, res, nw, EPS, weight)
    ref_out, ref_summed = native_rms_norm_linear(x, res, nw, EPS, weight)
    assert torch.equal(summed, ref_summed)
    assert rel_err(out, ref_out) < tolerance(torch.bfloat16)


def test_rms_norm_linear_w8a8_replays_in_a_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = quantize_weight(torch.randn(6144, 4096, device="cuda", generator=g) / 64,
                             w8a8_min_rows=64)
    x, res = rand(256, 4096, seed=6), rand(256, 4096, seed=7)
    nw = (1 + 0.1 * rand(4096, dtype=torch.float32, seed=5)).bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rms_norm_linear(x, res, nw, EPS, weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = rms_norm_linear(x, res, nw, EPS, weight)
    x.copy_(rand(256, 4096, seed=8))
    graph.replay()
    torch.cuda.synchronize()
    want, want_summed = rms_norm_linear(x, res, nw, EPS, weight)
    assert torch.equal(out, want) and torch.equal(summed, want_summed)
