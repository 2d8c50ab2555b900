"""The Triton ``linear``, ``silu_and_mul_linear``, ``rms_norm_linear`` and ``linear_partials``
with an ``Fp8Weight``, on CPU through TRITON_INTERPRET=1 with small shapes, against
``atom_core.quant.fp8.fp8_linear`` and the native ops: the weight-only GEMV (1 row, a few
rows, split-K, the fused forms, DeferredNorm inputs and outputs), the weight-only GEMM
past the GEMV's rows (fp8_gemm.py), which rows take which path, and the per-row
quantization kernel of the W8A8 path bit for bit against ``quantize_rows``.
tests/gpu/test_fp8_linear_gpu.py runs the real shapes and the W8A8 GEMM. Skipped where
triton is not installed."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import fp8_gemm, gemv, gemv_config, tuning  # noqa: E402
from atom_kernels_triton.activation import silu_and_mul  # noqa: E402
from atom_kernels_triton.fp8_gemm import GemmConfig, weight_only_linear  # noqa: E402
from atom_kernels_triton.fp8_quant import quantize_rows  # noqa: E402
from atom_kernels_triton.gemv import (  # noqa: E402
    linear,
    linear_partials,
    reads_deferred,
    rms_norm_linear,
    silu_and_mul_linear,
)
from atom_kernels_triton.gemv_config import MAX_ROWS, GemvConfig, fp8_config, get_config  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.deferred_norm import AddNorm, DeferredNorm, normed  # noqa: E402
from atom_core.ops.native import norm as native_norm  # noqa: E402
from atom_core.ops.native.activation import (  # noqa: E402
    silu_and_mul_linear as native_silu_and_mul_linear,
)
from atom_core.ops.native.linear import rms_norm_linear as native_rms_norm_linear  # noqa: E402
from atom_core.quant import fp8  # noqa: E402
from atom_core.quant.fp8 import Fp8Weight, fp8_linear, quantize_weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# N and K off every block size below; BLOCK_K 32 < K exercises the K loop and its tail.
N, K = 70, 200
EPS = 1e-6
SMALL = GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
SPLIT = GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
# The interpreter's tl.dot reads bf16 operands as raw bits: paths with a tl.dot (2+ rows,
# the GEMM) are checked in fp16 here and in bf16 by tests/gpu; the 1-row path in both.
ONE_ROW_DTYPES = [torch.float16, torch.bfloat16]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def fp8_weight(n: int = N, k: int = K, seed: int = 1,
               w8a8_min_rows: int = fp8.DEFAULT_W8A8_MIN_ROWS) -> Fp8Weight:
    return quantize_weight(rand(n, k, seed=seed) / k**0.5, w8a8_min_rows)


def table() -> gemv_config.GemvTable:
    """The table this device's launches read (empty on CPU: a test puts entries in)."""
    return tuning.table_for(gemv_config.OP, torch.device(DEVICE))


def w8a8_on_triton(m: int, n: int, k: int) -> bool:
    """Whether this device runs m rows' W8A8 product of an [n, k] weight on the Triton GEMM
    (always on CPU; on a GPU where its table lists the shape), not torch._scaled_mm."""
    return fp8_gemm.w8a8_table_config(m, n, k, torch.device(DEVICE)) is not None


class Record:
    """Stands in for a kernel: runs it, keeping each launch's keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def kernels(monkeypatch):
    """(the GEMV's launches, the weight-only GEMM's launches), recorded."""
    rec_gemv, rec_gemm = Record(gemv._gemv_kernel), Record(fp8_gemm._fp8_gemm_kernel)
    monkeypatch.setattr(gemv, "_gemv_kernel", rec_gemv)
    monkeypatch.setattr(fp8_gemm, "_fp8_gemm_kernel", rec_gemm)
    return rec_gemv.launches, rec_gemm.launches


def dtypes_for(m: int) -> list[torch.dtype]:
    return ONE_ROW_DTYPES if m == 1 or DEVICE == "cuda" else [torch.float16]


# --- the per-row quantization kernel (W8A8's activations) -----------------------------------


def quant_inputs(dtype: torch.dtype) -> torch.Tensor:
    x = rand(7, 300, seed=3) * torch.logspace(-6, 3, 7, device=DEVICE)[:, None]
    x[2] = 0.0  # the smallest scale, all zeros
    x[3, :50] = -0.0
    x[4, 5] = 1e-30
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_k", [None, 64], ids=["one-tile", "two-pass"])
def test_quantize_rows_is_bitwise_the_reference(dtype, block_k):
    x = quant_inputs(dtype)
    q, scale = quantize_rows(x, block_k)
    ref_q, ref_scale = fp8.quantize_rows(x)
    assert q.dtype == fp8.FP8_DTYPE and scale.dtype == torch.float32
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))  # signed zeros too


def test_quantize_rows_rounds_to_nearest_even():
    # A row whose largest magnitude is 448 has scale 1: each value is quantized as it is.
    # Ties go to the even neighbour, normal and subnormal; carries cross into the next
    # binade.
    cases = [
        (448.0, 448.0), (1.0625, 1.0), (1.1875, 1.25), (248.0, 256.0), (232.0, 224.0),
        (-1.0625, -1.0), (31.99, 32.0), (2.0**-10, 0.0), (3 * 2.0**-10, 2.0**-8),
        (5 * 2.0**-10, 2.0**-8), (-(2.0**-10), -0.0), (2.0**-6 - 2.0**-10, 2.0**-6),
        (0.3, 0.3125),
    ]
    x = torch.tensor([[v for v, _ in cases]], device=DEVICE)
    q, scale = quantize_rows(x)
    assert scale.item() == 1.0
    assert torch.equal(q.float(), torch.tensor([[e for _, e in cases]], device=DEVICE))
    assert torch.equal(q.view(torch.uint8), fp8.quantize_rows(x)[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_k", [None, 64], ids=["one-tile", "two-pass"])
def test_gated_quantize_rows_is_silu_and_mul_then_quantize_bitwise(dtype, block_k):
    # gate | up rows, one row all zeros and one of products near 1e3 (a scale per row).
    x = rand(5, 2 * 300, seed=6) * 3
    x[1] = 0.0
    x[2] *= 10
    x = x.to(dtype)
    q, scale = quantize_rows(x, block_k, gated=True)
    ref_q, ref_scale = fp8.quantize_rows(silu_and_mul(x))
    assert q.shape == (5, 300) and torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    # [2, 3, 2K] rows are flattened as the ungated form flattens them.
    q3, s3 = quantize_rows(x[:4].view(2, 2, 600), gated=True)
    assert torch.equal(q3.view(torch.uint8), q[:4].view(torch.uint8)) and torch.equal(s3, scale[:4])


def test_quantize_rows_three_d_and_strided():
    x = rand(2, 3, 2 * K, dtype=torch.bfloat16, seed=4)[..., :K]
    q, scale = quantize_rows(x)
    ref_q, ref_scale = fp8.quantize_rows(x.reshape(-1, K))
    assert q.shape == (6, K) and torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


# --- the weight-only GEMV -------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["no-split", "split-k"])
@pytest.mark.parametrize("has_bias", [False, True])
def test_gemv_matches_fp8_linear(m, config, has_bias, kernels):
    w = fp8_weight()
    for dtype in dtypes_for(m):
        x = rand(m, K, dtype=dtype, seed=m)
        b = rand(N, dtype=dtype, seed=2) if has_bias else None
        out = linear(x, w, b, config=config)
        assert out.dtype == dtype and out.shape == (m, N)
        # fp32 sums of the same e4m3 values: one rounding of the output apart.
        assert rel_err(out, fp8_linear(x, w, b)) < tolerance(dtype), dtype
    assert kernels[0] and all(k["W_SCALE"] for k in kernels[0]) and not kernels[1]


def test_gemv_three_d_input_strided_rows_and_default_config():
    w, b = fp8_weight(), rand(N, dtype=torch.float16, seed=2)
    x = rand(2, 3, K, dtype=torch.float16, seed=3)
    out = linear(x, w, b)
    assert out.shape == (2, 3, N)
    assert rel_err(out, fp8_linear(x, w, b)) < tolerance(torch.float16)
    x = rand(4, 2 * K, dtype=torch.float16, seed=4)[:, :K]
    assert rel_err(linear(x, w, config=SMALL), fp8_linear(x, w)) < tolerance(torch.float16)


def test_split_k_is_bitwise_reproducible_and_partials_sum_to_linear():
    w = fp8_weight()
    x = rand(3, K, dtype=torch.float16, seed=5)
    assert torch.equal(linear(x, w, config=SPLIT), linear(x, w, config=SPLIT))
    # linear_partials: the default config's splits (2 for one row and for three: a long K),
    # each scaled, added in order.
    w = fp8_weight(N, 2048)
    x = rand(3, 2048, dtype=torch.float16, seed=5)
    for m, splits in ((1, 2), (3, 2)):
        parts = linear_partials(x[:m], w)
        assert parts.shape == (splits, m, N) and parts.dtype == torch.float32
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        assert torch.equal(total.to(x.dtype), linear(x[:m], w))


def test_gemv_never_calls_cublas_for_fp8(kernels, monkeypatch):
    # Where the 16-bit table says cuBLAS (None), an e4m3 weight still gets a config.
    monkeypatch.setitem(table(), (N, K), {1: None, 4: None, 16: None})
    w = fp8_weight()
    for m in (1, 4, 16):
        assert get_config(m, N, K, 2) is None
        assert get_config(m, N, K, 1) == fp8_config(m, N, K, table={})
        x = rand(m, K, dtype=torch.float16, seed=m)
        assert rel_err(linear(x, w), fp8_linear(x, w)) < tolerance(torch.float16)
    assert len(kernels[0]) == 3


def test_fp8_config_one_row_from_the_16_bit_entries():
    # BLOCK_K doubles while the fp32 tile stays within 8192 values, the tile within K's
    # power of two and each split a chunk; a cuBLAS (None) entry takes the heuristic.
    one = GemvConfig(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
    wide = GemvConfig(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
    whole = GemvConfig(BLOCK_N=4, BLOCK_K=1024, SPLIT_K=3, num_warps=4, num_stages=2)
    t = {(4096, 4096): {1: one}, (6144, 4096): {1: wide}, (1024, 3072): {1: whole},
         (2048, 2048): {1: None}}
    assert fp8_config(1, 4096, 4096, table=t) == {**one, "BLOCK_K": 1024}
    assert fp8_config(1, 6144, 4096, table=t) == wide  # 16 x 1024 would pass 8192
    assert fp8_config(1, 1024, 3072, table=t) == whole  # 3 splits of 1024 cover K
    assert fp8_config(1, 2048, 2048, table=t) is not None
    assert fp8_config(1, 100, 300, table=t)["BLOCK_K"] <= 512  # K's power of two


def test_fp8_config_several_rows_ignores_the_16_bit_entries():
    # The tl.dot path's own rules (the H200 sweep's fastest at 4 and 16 rows of Qwen3-8B).
    dot = GemvConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4)
    t = {(4096, 4096): {4: dot, 16: None}}

    def tiles(m, n, k):
        c = fp8_config(m, n, k, 132, t)
        return c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]

    assert tiles(4, 4096, 4096) == (32, 256, 2)
    assert tiles(16, 4096, 4096) == (32, 512, 2)
    assert tiles(4, 6144, 4096) == (32, 256, 2)
    assert tiles(16, 24576, 4096) == (64, 128, 2)
    assert tiles(16, 4096, 12288) == (32, 512, 2)
    assert tiles(2, 70, 200) == (32, 256, 1)  # one chunk of K: no split


@pytest.mark.parametrize("device", sorted(
    json.loads(p.read_text())["device"]
    for p in (tuning.CONFIG_DIR / gemv_config.OP).glob("*.json")
))
def test_fp8_configs_of_shipped_tables(device):
    for (n, k) in gemv_config.tuned(device):
        for m in (1, 2, 4, 8, 16):
            c = fp8_config(m, n, k, table=gemv_config.tuned(device))
            assert c is not None, (n, k, m)
            if m == 1:
                assert c["BLOCK_N"] * c["BLOCK_K"] <= 8192, (n, k, c)
            else:
                assert c["BLOCK_N"] >= 16, (n, k, m, c)
            assert -(-k // c["BLOCK_K"]) >= c["SPLIT_K"], (n, k, m, c)


# --- the fused forms and deferred norms -----------------------------------------------------

KG = 777  # silu_and_mul_linear's K (x is 2 * KG wide), off every block size


def fused_config(split_k: int) -> GemvConfig:
    return GemvConfig(BLOCK_N=16, BLOCK_K=128, SPLIT_K=split_k, num_warps=4, num_stages=2)


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("has_bias", [False, True])
def test_silu_and_mul_linear_one_row(split_k, has_bias, kernels):
    w = fp8_weight(N, KG)
    for dtype in ONE_ROW_DTYPES:
        x = rand(1, 2 * KG, dtype=dtype, seed=3)
        b = rand(N, dtype=dtype, seed=2) if has_bias else None
        out = silu_and_mul_linear(x, w, b, config=fused_config(split_k))
        assert out.dtype == dtype
        assert rel_err(out, native_silu_and_mul_linear(x, w, b)) < tolerance(dtype)
        # silu(gate) * up rounded as silu_and_mul rounds it: the unfused pair's bits.
        assert torch.equal(out, linear(silu_and_mul(x), w, b, config=fused_config(split_k)))
    assert any(k["GATED"] and k["W_SCALE"] for k in kernels[0])


def test_silu_and_mul_linear_several_rows_take_the_two_ops(kernels):
    w = fp8_weight(N, KG)
    x = rand(3, 2 * KG, dtype=torch.float16, seed=3)
    out = silu_and_mul_linear(x, w)
    assert rel_err(out, native_silu_and_mul_linear(x, w)) < tolerance(torch.float16)
    assert not any(k["GATED"] for k in kernels[0])


def test_silu_and_mul_linear_at_w8a8_rows_quantizes_the_activation_in_one_kernel(kernels,
                                                                             monkeypatch):
    # From w8a8_min_rows the activation is formed and quantized by the gated quantization
    # kernel, never written in the model dtype: the same bits as silu_and_mul, then linear.
    w = fp8_weight(80, 192, w8a8_min_rows=4)
    b = rand(80, dtype=torch.float16, seed=2)
    x = rand(5, 2 * 192, dtype=torch.float16, seed=3)
    calls = []
    monkeypatch.setattr(gemv, "silu_and_mul", lambda t: calls.append(t) or silu_and_mul(t))
    out = silu_and_mul_linear(x, w, b)
    triton_gemm = w8a8_on_triton(5, 80, 192)
    assert not calls and [k["X_FP8"] for k in kernels[1]] == ([True] if triton_gemm else [])
    assert torch.equal(out, linear(silu_and_mul(x), w, b))
    assert rel_err(out, native_silu_and_mul_linear(x, w, b)) < tolerance(torch.float16)
    few = silu_and_mul_linear(x[:3], w, b)  # below w8a8_min_rows: the two ops
    assert len(calls) == 1 and torch.equal(few, linear(silu_and_mul(x[:3]), w, b))


def norm_inputs(m: int, k: int, dtype: torch.dtype, residual: bool):
    x = rand(m, k, dtype=dtype, seed=3)
    res = rand(m, k, dtype=dtype, seed=4) if residual else None
    return x, res, (1 + 0.1 * rand(k, seed=5)).to(dtype)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_linear(m, split_k, residual, kernels):
    w, b = fp8_weight(N, KG), rand(N, dtype=torch.float16, seed=7)
    x, res, nw = norm_inputs(m, KG, torch.float16, residual)
    out, summed = rms_norm_linear(x, res, nw, EPS, w, b, config=fused_config(split_k))
    ref_out, ref_summed = native_rms_norm_linear(x, res, nw, EPS, w, b)
    assert out.dtype == torch.float16 and out.shape == (m, N)
    # The residual sum is bit for bit the norm op's; the product formed from h * g and
    # scaled after is about one rounding of x off the reference's.
    assert torch.equal(summed, ref_summed)
    assert rel_err(out, ref_out) < tolerance(torch.float16)
    assert any(k["NORM"] for k in kernels[0]) == (m == 1)


def deferred(h: torch.Tensor, weight: torch.Tensor, parts: int) -> DeferredNorm:
    """What a producer leaves for h, its h * h summed over ``parts`` column blocks."""
    hf = h.float()
    sumsq = torch.stack([c.pow(2).sum(-1) for c in hf.chunk(parts, dim=-1)])
    return DeferredNorm(h, (hf * weight.float()).to(h.dtype), sumsq, weight, EPS)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["no-split", "split-k"])
def test_linear_reads_a_deferred_norm(m, config, kernels):
    w, b = fp8_weight(), rand(N, dtype=torch.float16, seed=2)
    h, nw = rand(m, K, dtype=torch.float16, seed=6), (1 + 0.1 * rand(K, seed=5)).half()
    d = deferred(h, nw, 2)
    assert reads_deferred(h, w)
    out = linear(d, w, b, config=config)
    ref = fp8_linear(normed(d, native_norm.rms_norm), w, b)
    assert rel_err(out, ref) < tolerance(torch.float16)
    assert kernels[0][-1]["ROW_SS"] == (2 if config is SMALL else 0)


def test_split_k_reduce_finishes_an_add_norm():
    w, b = fp8_weight(), rand(N, dtype=torch.float16, seed=2)
    x, res = rand(3, K, dtype=torch.float16, seed=1), rand(3, N, dtype=torch.float16, seed=4)
    nw = (1 + 0.1 * rand(N, seed=5)).half()
    d = linear(x, w, b, config=SPLIT, add_norm=AddNorm(res, nw, EPS, reader=fp8_weight(K, N)))
    assert isinstance(d, DeferredNorm)
    ref_normed, ref_summed = native_norm.fused_add_rms_norm(
        linear(x, w, b, config=SPLIT), res, nw, EPS)
    assert torch.equal(d.summed, ref_summed)
    assert torch.equal(normed(d, native_norm.rms_norm), ref_normed)


# --- the weight-only GEMM, and which rows take which path -----------------------------------


def gemm_config(swap: bool, split_k: int, block_m: int = 16) -> GemmConfig:
    return GemmConfig(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=32, SPLIT_K=split_k, SWAP=swap,
                      num_warps=4, num_stages=2)


@pytest.mark.parametrize("m", [17, 40])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "x-w"])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("has_bias", [False, True])
def test_weight_only_gemm_matches_fp8_linear(m, swap, split_k, has_bias):
    # M, N and K all ragged against the tiles; 40 rows are three M tiles.
    w = fp8_weight()
    x = rand(m, K, dtype=torch.float16, seed=m)
    b = rand(N, dtype=torch.float16, seed=2) if has_bias else None
    out = weight_only_linear(x, w, b, config=gemm_config(swap, split_k))
    assert out.dtype == torch.float16 and out.shape == (m, N)
    assert rel_err(out, fp8_linear(x, w, b, w8a8=False)) < tolerance(torch.float16)
    if split_k > 1:
        assert torch.equal(out, weight_only_linear(x, w, b, config=gemm_config(swap, split_k)))


def test_weight_only_gemm_whole_k_tiles_and_3d_input():
    # K a multiple of BLOCK_K: the unmasked loads.
    w = fp8_weight(48, 256)
    x = rand(2, 10, 256, dtype=torch.float16, seed=3)
    out = weight_only_linear(x, w, config=gemm_config(True, 2, block_m=32))
    assert out.shape == (2, 10, 48)
    assert rel_err(out, fp8_linear(x, w, w8a8=False)) < tolerance(torch.float16)


def test_gemm_default_config():
    sms = 132
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (70, 200)]:
        for m in (17, 32, 33, 64, 65, 128, 255):
            c = fp8_gemm.default_config(m, n, k, sms)
            tiles = -(-n // c["BLOCK_N"]) * -(-m // c["BLOCK_M"])
            # One M tile up to 64 rows; 4 splits where the tiles leave SMs without two
            # programs, else 2, each split >= 4 chunks of K.
            assert c["BLOCK_M"] >= m or m > 64, (m, c)
            assert c["SWAP"] == (c["BLOCK_M"] == 64 and m <= 64), (m, c)
            chunks = -(-k // c["BLOCK_K"])
            want = 4 if tiles < 2 * sms else 2
            while want > 1 and chunks < 4 * want:
                want //= 2
            assert c["SPLIT_K"] == want, (n, k, m, c)


@pytest.mark.parametrize("m", [1, 17, 40])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "x-w"])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("has_bias", [False, True])
def test_w8a8_gemm_matches_the_reference(m, swap, split_k, has_bias):
    # Both operands e4m3: the products are exact in fp32, so only the order of the sums
    # and the output's rounding differ from the reference's.
    w = fp8_weight()
    xq, xs = quantize_rows(rand(m, K, seed=m) * torch.logspace(-2, 2, m)[:, None].to(DEVICE))
    b = rand(N, dtype=torch.float16, seed=2) if has_bias else None
    out = fp8_gemm.w8a8_matmul(xq, xs, w, b, torch.float16, config=gemm_config(swap, split_k))
    assert out.dtype == torch.float16 and out.shape == (m, N)
    assert rel_err(out, fp8.w8a8_matmul(xq, xs, w, b, torch.float16)) < 1e-3
    if split_k > 1:
        again = fp8_gemm.w8a8_matmul(xq, xs, w, b, torch.float16,
                                     config=gemm_config(swap, split_k))
        assert torch.equal(out, again)


def test_w8a8_config():
    sms = 132
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (70, 200)]:
        for m in (1, 17, 32, 33, 64, 65, 128):
            c = fp8_gemm.w8a8_config(m, n, k, sms)
            assert c["SWAP"] and c["BLOCK_M"] == min(64, max(16, 1 << (m - 1).bit_length()))
            assert c["BLOCK_K"] == min(256, 1 << (k - 1).bit_length())
            tiles = -(-n // c["BLOCK_N"]) * -(-m // c["BLOCK_M"])
            assert c["BLOCK_N"] == 64 or tiles >= sms, (n, m, c)
            chunks = -(-k // c["BLOCK_K"])
            want = 4 if tiles < 2 * sms else 2
            while want > 1 and chunks < 4 * want:
                want //= 2
            assert c["SPLIT_K"] == want, (n, k, m, c)


def test_w8a8_table_picks_the_triton_gemm_or_scaled_mm(monkeypatch):
    # CUDA tensors: the device table's entry for (N, K) and the row bucket, else (no entry,
    # a null one, past the largest bucket) torch._scaled_mm; CPU tensors: the heuristic.
    tiles = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "SWAP": True,
             "num_warps": 4, "num_stages": 4}
    table = {(4096, 4096): {16: None, 32: tiles}}
    monkeypatch.setattr(tuning, "table_for", lambda op, device: table if op == "fp8_w8a8" else {})
    cuda = torch.device("cuda")
    assert [fp8_gemm.m_bucket(m) for m in (1, 16, 17, 32, 33, 128)] == [16, 16, 32, 32, 64, 128]
    assert fp8_gemm.w8a8_table_config(17, 4096, 4096, cuda) == tiles
    assert fp8_gemm.w8a8_table_config(32, 4096, 4096, cuda) == tiles
    for m, n in [(8, 4096), (33, 4096), (129, 4096), (32, 6144)]:
        assert fp8_gemm.w8a8_table_config(m, n, 4096, cuda) is None, (m, n)
    cpu = torch.device("cpu")
    assert fp8_gemm.w8a8_table_config(8, 4096, 4096, cpu) == fp8_gemm.w8a8_config(8, 4096, 4096)
    assert fp8_gemm.w8a8_table_config(512, 64, 64, cpu) == fp8_gemm.w8a8_config(512, 64, 64)


def test_rows_pick_the_path(kernels):
    # Up to MAX_ROWS rows: the GEMV; then the weight-only GEMM below w8a8_min_rows; from
    # there W8A8: the rows quantized, then the same GEMM on e4m3 operands where the device
    # routes the shape to it, else torch._scaled_mm.
    w = fp8_weight(80, 192, w8a8_min_rows=24)
    gemv_launches, gemm_launches = kernels
    triton_w8a8 = w8a8_on_triton(24, 80, 192)
    for m, path in [(MAX_ROWS, "gemv"), (MAX_ROWS + 1, "gemm"), (23, "gemm"), (24, "w8a8")]:
        gemv_launches.clear()
        gemm_launches.clear()
        x = rand(m, 192, dtype=torch.float16, seed=m)
        out = linear(x, w)
        assert bool(gemv_launches) == (path == "gemv")
        expected = {"gemv": [], "gemm": [False], "w8a8": [True] if triton_w8a8 else []}[path]
        assert [launch["X_FP8"] for launch in gemm_launches] == expected
        assert reads_deferred(x, w) == (path == "gemv")
        assert rel_err(out, fp8_linear(x, w)) < tolerance(torch.float16)
        if path == "w8a8":
            assert torch.equal(linear_partials(x, w)[0], out)


def test_fused_forms_and_deferred_norms_past_the_gemv(kernels):
    # Past one row the fused forms are the two ops, the product through the GEMM; a
    # DeferredNorm past MAX_ROWS is normed first.
    w = fp8_weight(N, KG, w8a8_min_rows=64)
    m = MAX_ROWS + 4
    x = rand(m, 2 * KG, dtype=torch.float16, seed=3)
    assert rel_err(silu_and_mul_linear(x, w), native_silu_and_mul_linear(x, w)) < tolerance(
        torch.float16)
    x, res, nw = norm_inputs(m, KG, torch.float16, True)
    out, summed = rms_norm_linear(x, res, nw, EPS, w)
    ref_out, ref_summed = native_rms_norm_linear(x, res, nw, EPS, w)
    assert torch.equal(summed, ref_summed) and rel_err(out, ref_out) < tolerance(torch.float16)
    d = deferred(x, nw, 2)
    assert rel_err(linear(d, w), fp8_linear(normed(d, native_norm.rms_norm), w)) < tolerance(
        torch.float16)
    assert not kernels[0] and len(kernels[1]) == 3


def test_what_the_kernels_do_not_take_goes_to_the_reference(kernels):
    w = fp8_weight()
    x = rand(2, K, seed=3)  # fp32 x
    assert not gemv.supported(x, w, None)
    assert torch.equal(linear(x, w), fp8_linear(x, w))
    b32 = rand(N, seed=2)  # a bias not in x's dtype
    xh = x.half()
    assert not gemv.supported(xh, w, b32)
    assert torch.equal(linear(xh, w, b32), fp8_linear(xh, w, b32))
    assert not any(kernels)
