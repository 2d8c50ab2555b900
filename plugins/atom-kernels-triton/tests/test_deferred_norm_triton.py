"""Deferred norms (``atom_core.ops.deferred_norm``) through the Triton ops, on CPU with
TRITON_INTERPRET=1: the split-K reduce and the MoE's pairs' sum finishing the next residual
add and RMSNorm, and the GEMV, the router and the experts reading the result, each against
the unfused ops. Skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from atom_kernels_triton import gemv  # noqa: E402
from atom_kernels_triton.fused_moe import fused_moe  # noqa: E402
from atom_kernels_triton.fused_moe_config import MoeConfig  # noqa: E402
from atom_kernels_triton.gemv import linear, silu_and_mul_linear  # noqa: E402
from atom_kernels_triton.gemv_config import GemvConfig  # noqa: E402
from atom_kernels_triton.moe_topk import route  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.deferred_norm import AddNorm, DeferredNorm, normed  # noqa: E402
from atom_core.ops.native import norm as native_norm  # noqa: E402
from atom_core.ops.native.moe import fused_moe as native_fused_moe  # noqa: E402
from atom_core.ops.native.moe import route as native_route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 70, 200
EPS = 1e-6
SMALL = GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
SPLIT = GemvConfig(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
TINY_MOE = MoeConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def norm_weight(n: int, dtype=torch.float32):
    return (1 + 0.1 * rand(n, seed=5)).to(dtype)


def deferred(h: torch.Tensor, weight: torch.Tensor, parts: int) -> DeferredNorm:
    """What a producer leaves for h, its h * h summed over ``parts`` column blocks."""
    hf = h.float()
    sumsq = torch.stack([c.pow(2).sum(-1) for c in hf.chunk(parts, dim=-1)])
    return DeferredNorm(h, (hf * weight.float()).to(h.dtype), sumsq, weight, EPS)


def reduce_blocks(n: int) -> int:
    """The split-K reduce's column blocks (gemv._launch)."""
    return -(-n // min(1024, 1 << (n - 1).bit_length()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [2, 5])
@pytest.mark.parametrize("has_bias", [False, True])
def test_split_k_reduce_finishes_the_add_and_norm(dtype, m, has_bias):
    x, w = rand(m, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2)
    b = rand(N, dtype=dtype, seed=3) if has_bias else None
    res, nw = rand(m, N, dtype=dtype, seed=4), norm_weight(N, dtype)
    d = linear(x, w, b, config=SPLIT, add_norm=AddNorm(res, nw, EPS))
    assert isinstance(d, DeferredNorm) and d.eps == EPS and d.weight is nw
    # The reduce sums the splits as it does without add_norm; h and h * weight are then
    # rounded as fused_add_rms_norm rounds them: bit for bit.
    ref_normed, ref_summed = native_norm.fused_add_rms_norm(
        linear(x, w, b, config=SPLIT), res, nw, EPS
    )
    assert torch.equal(d.summed, ref_summed)
    assert torch.equal(d.scaled, (ref_summed.float() * nw.float()).to(dtype))
    assert d.sumsq.shape == (reduce_blocks(N), m)
    torch.testing.assert_close(d.sumsq.sum(0), ref_summed.float().pow(2).sum(-1), rtol=1e-5, atol=0)
    assert torch.equal(normed(d, native_norm.rms_norm), ref_normed)


def test_producers_decline_where_no_reduce_runs():
    # No split-K reduce (an unsplit tile, or one row): the plain product, for the caller to
    # add and norm.
    x, w = rand(4, K, seed=1), rand(N, K, seed=2)
    out = linear(x, w, config=SMALL, add_norm=AddNorm(rand(4, N, seed=4), norm_weight(N), EPS))
    assert isinstance(out, torch.Tensor) and torch.equal(out, linear(x, w, config=SMALL))
    one = linear(x[:1], w, config=SPLIT, add_norm=AddNorm(rand(1, N, seed=4), norm_weight(N), EPS))
    assert isinstance(one, torch.Tensor) and torch.equal(one, linear(x[:1], w, config=SPLIT))


def test_silu_and_mul_linear_passes_add_norm_on():
    gate_up, w = rand(3, 2 * K, seed=1), rand(N, K, seed=2)
    res, nw = rand(3, N, seed=4), norm_weight(N)
    d = silu_and_mul_linear(gate_up, w, config=SPLIT, add_norm=AddNorm(res, nw, EPS))
    assert isinstance(d, DeferredNorm)
    _, ref_summed = native_norm.fused_add_rms_norm(silu_and_mul_linear(gate_up, w, config=SPLIT),
                                                   res, nw, EPS)
    assert torch.equal(d.summed, ref_summed)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["no-split", "split-k"])
@pytest.mark.parametrize("parts", [1, 3])
def test_linear_reads_a_deferred_norm(m, config, parts):
    h, nw, w, b = rand(m, K, seed=1), norm_weight(K), rand(N, K, seed=2), rand(N, seed=3)
    out = linear(deferred(h, nw, parts), w, b, config=config)
    ref = F.linear(native_norm.rms_norm(h, nw, EPS), w, b)
    assert out.shape == (m, N) and rel_err(out, ref) < tolerance(torch.float32)


def test_linear_reads_a_deferred_norm_in_half_precision():
    # One rounding of the product's input moves (h * weight, not the normed row): within
    # the dtype's tolerance of the unfused ops.
    h, nw = rand(5, K, dtype=torch.float16, seed=1), norm_weight(K, torch.float16)
    w = rand(N, K, dtype=torch.float16, seed=2)
    out = linear(deferred(h, nw, 2), w, config=SPLIT)
    ref = F.linear(native_norm.rms_norm(h, nw, EPS).float(), w.float())
    assert rel_err(out, ref) < tolerance(torch.float16)


def test_linear_normalises_where_cublas_serves(monkeypatch):
    monkeypatch.setattr(gemv, "get_config", lambda *a: None)
    h, nw, w = rand(3, K, seed=1), norm_weight(K), rand(N, K, seed=2)
    out = linear(deferred(h, nw, 2), w)
    ref = F.linear(native_norm.rms_norm(h, nw, EPS), w)
    assert rel_err(out, ref) < tolerance(torch.float32)


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_reads_a_deferred_norm(tokens, scoring):
    h, nw = rand(tokens, K, seed=1), norm_weight(K)
    gate = rand(16, K, seed=2) / K**0.5
    weights, ids = route(deferred(h, nw, 4), gate, 4, scoring, True)
    ref_w, ref_ids = native_route(native_norm.rms_norm(h, nw, EPS), gate, 4, scoring, True)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(-1, order), ref_ids.gather(-1, ref_order))
    torch.testing.assert_close(weights.gather(-1, order), ref_w.gather(-1, ref_order), rtol=1e-5,
                               atol=1e-6)


def moe_inputs(tokens, experts=6, top_k=2, hidden=40, inter=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights = torch.rand(tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return [t.to(DEVICE) for t in (w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_moe_reads_a_deferred_norm(tokens):
    w13, w2, weights, ids = moe_inputs(tokens)
    h, nw = rand(tokens, 40, seed=1), norm_weight(40)
    got = fused_moe(deferred(h, nw, 3), w13, w2, weights, ids, config=TINY_MOE)
    ref = native_fused_moe(native_norm.rms_norm(h, nw, EPS), w13, w2, weights, ids)
    assert rel_err(got, ref) < tolerance(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden,top_k", [(40, 2), (600, 8)])  # one column block, then two
def test_pairs_sum_finishes_the_add_and_norm(dtype, hidden, top_k):
    tokens = 5
    w13, w2, weights, ids = moe_inputs(tokens, experts=10, top_k=top_k, hidden=hidden, dtype=dtype)
    x, res = rand(tokens, hidden, dtype=dtype, seed=1), rand(tokens, hidden, dtype=dtype, seed=2)
    nw = norm_weight(hidden, dtype)
    d = fused_moe(x, w13, w2, weights, ids, config=TINY_MOE, add_norm=AddNorm(res, nw, EPS))
    assert isinstance(d, DeferredNorm)
    plain = fused_moe(x, w13, w2, weights, ids, config=TINY_MOE)
    ref_normed, ref_summed = native_norm.fused_add_rms_norm(plain, res, nw, EPS)
    assert torch.equal(d.summed, ref_summed)
    assert torch.equal(d.scaled, (ref_summed.float() * nw.float()).to(dtype))
    blocks = -(-hidden // min(4096 // top_k, 1 << (hidden - 1).bit_length()))
    assert d.sumsq.shape == (blocks, tokens)
    torch.testing.assert_close(d.sumsq.sum(0), ref_summed.float().pow(2).sum(-1), rtol=1e-5, atol=0)
    assert torch.equal(normed(d, native_norm.rms_norm), ref_normed)


def test_native_ops_decline_and_normalise():
    from atom_core.ops.native.linear import linear as native_linear

    h, nw, w = rand(3, K, seed=1), norm_weight(K), rand(N, K, seed=2)
    d = deferred(h, nw, 2)
    assert torch.equal(native_linear(d, w), F.linear(native_norm.rms_norm(h, nw, EPS), w))
    x = rand(3, K, seed=3)
    out = native_linear(x, w, add_norm=AddNorm(rand(3, N, seed=4), norm_weight(N), EPS))
    assert isinstance(out, torch.Tensor) and torch.equal(out, F.linear(x, w))


def test_producers_decline_where_the_reader_norms_for_cublas(monkeypatch):
    # The reader's shape goes to cuBLAS: it would norm the rows itself, so the reduce does
    # not leave a DeferredNorm for it. A reader of no linear op (None) always takes one.
    x, w = rand(4, K, seed=1), rand(N, K, seed=2)
    res, nw, reader = rand(4, N, seed=4), norm_weight(N), rand(64, N, seed=5)
    assert isinstance(linear(x, w, config=SPLIT, add_norm=AddNorm(res, nw, EPS, reader)),
                      DeferredNorm)
    table = gemv.get_config
    monkeypatch.setattr(gemv, "get_config", lambda m, n, *a: None if n == 64 else table(m, n, *a))
    out = linear(x, w, config=SPLIT, add_norm=AddNorm(res, nw, EPS, reader))
    assert isinstance(out, torch.Tensor) and torch.equal(out, linear(x, w, config=SPLIT))
    assert isinstance(linear(x, w, config=SPLIT, add_norm=AddNorm(res, nw, EPS)), DeferredNorm)
