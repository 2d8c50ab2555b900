"""The Triton fused_moe with ``Fp8Weight`` expert stacks against the native fp8 reference, on
CPU through TRITON_INTERPRET=1 with tiny shapes: weight-only and W8A8, shared experts,
out-of-range ids, the counted launch forms, a DeferredNorm input, and the row quantizer.
Skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton.fused_moe import fused_moe  # noqa: E402
from atom_kernels_triton.fused_moe_config import MoeConfig  # noqa: E402
from atom_kernels_triton.fused_moe_fp8 import quantize_rows  # noqa: E402
from triton_reference import rel_err  # noqa: E402

from atom_core.ops.deferred_norm import DeferredNorm  # noqa: E402
from atom_core.ops.native.moe import fused_moe as native_fused_moe  # noqa: E402
from atom_core.quant import fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# BLOCK_K 32: an e4m3 dot's smallest K tile; H and I past it and not multiples of the
# tiles, so the K loop runs and every edge is masked.
TINY = MoeConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
HIDDEN, INTER = 72, 40
# The kernels and the reference see the same e4m3 operands; they differ by fp32 sum order
# and the model-dtype roundings it flips (in W8A8 an intermediate value's e4m3 rounding, now
# and then): fp16 as the bf16 op's tests allow, fp32 a little more than their 1e-5 for the
# rare flipped e4m3 value.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}


def fp8_inputs(tokens, experts, top_k, dtype, w8a8, seed=0):
    """Inputs whose token count is past (W8A8) or short of the stacks' w8a8_min_rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) / INTER**0.5
    weights = torch.rand(tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    min_rows = tokens if w8a8 else tokens + 1
    q13 = fp8.quantize_weight(w13.to(DEVICE), min_rows)
    q2 = fp8.quantize_weight(w2.to(DEVICE), min_rows)
    return x.to(dtype).to(DEVICE), q13, q2, weights.to(DEVICE), ids.to(DEVICE)


def check(x, w13, w2, weights, ids, shared=0, config=TINY):
    got = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=config)
    ref = native_fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < TOLERANCE[x.dtype]
    return got


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (7, 3), (19, 2)])
def test_matches_native_fp8(w8a8, dtype, tokens, top_k):
    check(*fp8_inputs(tokens, 6, top_k, dtype, w8a8))


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_the_format_follows_the_token_count(w8a8):
    # The same operands in the other format are off by the activations' e4m3 rounding, far
    # past the tolerance: the kernel ran the format the reference did.
    x, w13, w2, weights, ids = fp8_inputs(9, 6, 2, torch.float32, w8a8)
    got = check(x, w13, w2, weights, ids)
    flip = 10**6 if w8a8 else 1
    other = native_fused_moe(x, w13._replace(w8a8_min_rows=flip),
                             w2._replace(w8a8_min_rows=flip), weights, ids)
    assert rel_err(got, other) > 100 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_shared_experts_and_skipped_ids(w8a8, tokens):
    # Two of the 8 stacked experts are shared; a routed slot of another rank (-1, or past the
    # experts) adds nothing, and the shared slots still count.
    x, w13, w2, weights, ids = fp8_inputs(tokens, 8, 3, torch.float16, w8a8)
    ids = ids % 6
    ids[0, 1] = -1
    if tokens > 1:
        ids[1, 0] = 8
    check(x, w13, w2, weights, ids, shared=2)


PERSISTENT = MoeConfig(**TINY, PERSISTENT=4)
OVERLAP = MoeConfig(**TINY, OVERLAP=True)


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("variant", [PERSISTENT, OVERLAP], ids=["persistent", "overlap"])
def test_counted_launch_configs(w8a8, variant):
    # Weight-only runs the counted forms' own tiles (bitwise the two launches', as for the
    # model dtype); W8A8 takes the two launches whatever the config says.
    x, w13, w2, weights, ids = fp8_inputs(7, 8, 3, torch.float16, w8a8)
    ids = ids % 6
    ids[0, 0] = -1
    two = fused_moe(x, w13, w2, weights, ids, num_shared_experts=2, config=TINY)
    assert torch.equal(check(x, w13, w2, weights, ids, shared=2, config=variant), two)


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_reads_a_deferred_norm(w8a8):
    x, w13, w2, weights, ids = fp8_inputs(5, 6, 2, torch.float32, w8a8)
    h, gamma = x, torch.rand(HIDDEN, device=x.device) + 0.5
    # Three column blocks' partial sums of h * h.
    sumsq = (h * h).reshape(5, 3, HIDDEN // 3).sum(-1).T.contiguous()
    deferred = DeferredNorm(h, h * gamma, sumsq, gamma, 1e-6)
    got = fused_moe(deferred, w13, w2, weights, ids, config=TINY)
    normed = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * gamma
    assert rel_err(got, native_fused_moe(normed, w13, w2, weights, ids)) < 1e-4


@pytest.mark.parametrize("cols", [5, 72, 1500])  # 1500: two column tiles a row
def test_quantize_rows_equals_the_reference(cols):
    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(11, cols, generator=g) * torch.logspace(-3, 2, 11)[:, None])
    x[3] = 0.0  # an all-zero row takes the smallest scale
    x = x.to(torch.float16).to(DEVICE)
    q, scale = quantize_rows(x)
    want_q, want_scale = fp8.quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_rows_skips_padding_rows(monkeypatch):
    # Rows whose pair is past the pairs are the layout's padding: never written (the buffers
    # are poisoned with NaN to show it), the others quantized as the reference does.
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    pairs = torch.tensor([0, 9, 3, 10, 10, 1, 2, 12], dtype=torch.int32, device=DEVICE)
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    q, scale = quantize_rows(x, pairs=pairs, num_pairs=10)
    real = pairs < 10
    want_q, want_scale = fp8.quantize_rows(x[real])
    assert torch.equal(scale[real], want_scale)
    assert torch.equal(q[real].view(torch.uint8), want_q.view(torch.uint8))
    assert scale[~real].isnan().all() and q[~real].float().isnan().all()


def test_w8a8_raises_a_short_k_tile():
    # The model-dtype tests' 16-wide K tile is below an e4m3 dot's smallest; W8A8 takes 32.
    from atom_kernels_triton.fused_moe_config import for_w8a8

    short = MoeConfig(**{**TINY, "BLOCK_K": 16})
    assert for_w8a8(short) == TINY and for_w8a8(TINY) is TINY
    check(*fp8_inputs(5, 6, 2, torch.float16, True), config=short)


def test_weight_only_tiles():
    # The one-token persistent launch's K tile doubles to its model-dtype tile's bytes; the
    # others are the table's.
    from atom_kernels_triton.fused_moe_config import for_fp8_weights

    assert for_fp8_weights(PERSISTENT) == MoeConfig(**{**PERSISTENT, "BLOCK_K": 64})
    assert for_fp8_weights(TINY) is TINY and for_fp8_weights(OVERLAP) is OVERLAP


def test_fp8_formats_look_up_their_own_table_keys():
    from atom_kernels_triton import fused_moe_config as cfg

    bf16_tile = MoeConfig(**{**PERSISTENT, "BLOCK_K": 16})
    swept = MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1)
    table = {(HIDDEN, INTER): {32: bf16_tile}, (HIDDEN, INTER, cfg.W8A8): {32: swept}}
    assert cfg.get_config(19, 2, 6, HIDDEN, INTER, table) is bf16_tile
    assert cfg.get_config(19, 2, 6, HIDDEN, INTER, table, cfg.W8A8) is swept
    # No weight-only key: the model-dtype tile adapted (persistent: its K tile doubled).
    assert cfg.get_config(19, 2, 6, HIDDEN, INTER, table, cfg.WEIGHT_ONLY) == MoeConfig(
        **{**PERSISTENT, "BLOCK_K": 32})
    # Past the swept buckets W8A8 takes the shape heuristic, as the model dtype does.
    assert cfg.get_config(64, 2, 6, HIDDEN, INTER, table, cfg.W8A8) == cfg.default_config(
        64, 2, 6)


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_launch_asks_the_table_for_its_format(monkeypatch, w8a8):
    from atom_kernels_triton import fused_moe as launcher
    from atom_kernels_triton import fused_moe_config as cfg

    asked = []

    def get_config(*args):
        asked.append(args[-1])
        return TINY

    monkeypatch.setattr(launcher, "get_config", get_config)
    x, w13, w2, weights, ids = fp8_inputs(7, 6, 3, torch.float16, w8a8)
    got = fused_moe(x, w13, w2, weights, ids)
    assert asked == [cfg.W8A8 if w8a8 else cfg.WEIGHT_ONLY]
    assert rel_err(got, native_fused_moe(x, w13, w2, weights, ids)) < TOLERANCE[x.dtype]
