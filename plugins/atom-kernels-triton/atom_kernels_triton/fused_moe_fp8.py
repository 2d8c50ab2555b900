"""FP8 expert stacks (``Fp8Weight``) in the fused-MoE kernels: which format a GEMM runs in,
and the per-row quantization of the W8A8 GEMMs' inputs.

A stack's format is picked by the step's token count T, as the native op picks it
(``atom_core.ops.native.moe``): below its ``w8a8_min_rows``, ``WEIGHT_ONLY``: the tiles
load e4m3 weights and convert them to the activations' dtype (exactly) before the dot, and
the fp32 accumulator is scaled per output column; from there on, ``W8A8``: the GEMM's input
rows are quantized per row first (the hidden rows per token, the intermediate per
(token, expert) row), the dot is e4m3 x e4m3 into fp32, and the accumulator is scaled by its
row's and its column's scales.

``quantize_rows`` here is ``atom_core.quant.fp8.quantize_rows``'s arithmetic (the rounding
is fp8_quant.py's, which is torch's) over the rows the MoE kernels read: the normed rows of
a ``DeferredNorm``, and the expert-sorted intermediate whose padding rows no pair owns
(skipped: they hold whatever the buffer held).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.quant.fp8 import FP8_DTYPE, Fp8Weight
from atom_kernels_triton.deferred_norm import row_rms_scale
from atom_kernels_triton.fp8_quant import hardware_rounds_e4m3, quantize_e4m3, row_scale
from atom_kernels_triton.fused_moe_config import W8A8, WEIGHT_ONLY
from atom_kernels_triton.pdl import pdl_options, pdl_wait

# A GEMM's format: its weight in the model dtype, e4m3 weights only (WEIGHT_ONLY), or both
# operands e4m3 (W8A8).
MODEL_DTYPE = 0
# Rows a program quantizes, and the widest column tile it holds.
_BLOCK_R = 4
_MAX_BLOCK_K = 1024


def fp8_mode(weight: torch.Tensor | Fp8Weight, num_tokens: int) -> int:
    """The format of a step of ``num_tokens`` tokens' GEMM with ``weight``."""
    if not isinstance(weight, Fp8Weight):
        return MODEL_DTYPE
    return W8A8 if num_tokens >= weight.w8a8_min_rows else WEIGHT_ONLY


def weight_operands(weight: torch.Tensor | Fp8Weight
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values [E, N, K], scales [E, N] with unit column stride, the scales' expert stride).
    A model-dtype stack has no scales: the values stand in for the unread pointer."""
    if not isinstance(weight, Fp8Weight):
        return weight, weight, 0
    scale = weight.scale if weight.scale.stride(-1) == 1 else weight.scale.contiguous()
    return weight.qweight, scale, scale.stride(0)


@triton.jit
def _row_values(x_ptr, x_off, mask, rs, ROW_SS: tl.constexpr):
    """The rows' values in fp32: as stored, or a DeferredNorm's h * weight times each row's
    1/rms, rounded to the model dtype as the norm's output is."""
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    if ROW_SS > 0:
        return (x.to(tl.float32) * rs[:, None]).to(x.dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, x_stride, q_ptr, s_ptr, num_rows, K, pairs_ptr, num_pairs, ss_ptr, eps,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SKIP_PADDING: tl.constexpr,
    ROW_SS: tl.constexpr, RECIPROCAL: tl.constexpr, HW_ROUND: tl.constexpr, PDL: tl.constexpr,
):
    """Rows [pid * BLOCK_R, +BLOCK_R): one pass for the rows' largest magnitude, one to
    quantize. SKIP_PADDING: a row whose ``pairs_ptr`` entry is past the pairs is left alone.
    ROW_SS > 0: x is a DeferredNorm's h * weight with ROW_SS partial sums of squares."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    if SKIP_PADDING:
        ok &= tl.load(pairs_ptr + rows, mask=ok, other=num_pairs) < num_pairs
    rs = tl.zeros((BLOCK_R,), tl.float32)
    if ROW_SS > 0:
        rs = row_rms_scale(ss_ptr, rows, ok, num_rows, K, eps, ROW_SS)
    ks = tl.arange(0, BLOCK_K)
    x_rows = rows[:, None].to(tl.int64) * x_stride
    amax = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = _row_values(x_ptr, x_rows + kk[None, :], ok[:, None] & (kk < K)[None, :], rs, ROW_SS)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=1), RECIPROCAL)
    tl.store(s_ptr + rows, scale, mask=ok)
    inv = tl.math.div_rn(1.0, scale)
    q_rows = rows[:, None].to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        mask = ok[:, None] & (kk < K)[None, :]
        x = _row_values(x_ptr, x_rows + kk[None, :], mask, rs, ROW_SS)
        q = quantize_e4m3(x, inv[:, None], HW_ROUND)
        tl.store(q_ptr + q_rows + kk[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(
    x: torch.Tensor, *, pairs: torch.Tensor | None = None, num_pairs: int = 0,
    sumsq: torch.Tensor | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M]) of x [M, K] (unit column stride), one scale a row.
    ``pairs`` [M]: the expert-sorted layout's pair of each row; rows whose pair is
    ``num_pairs`` or past it are padding, left unwritten. ``sumsq`` [S, M]: x is a
    ``DeferredNorm``'s h * weight, and the normed rows are quantized."""
    num_rows, k = x.shape
    q = torch.empty((num_rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows,), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    _quantize_rows_kernel[(triton.cdiv(num_rows, _BLOCK_R),)](
        x, x.stride(0), q, scale, num_rows, k, pairs if pairs is not None else scale, num_pairs,
        sumsq if sumsq is not None else scale, eps,
        BLOCK_R=_BLOCK_R, BLOCK_K=min(triton.next_power_of_2(k), _MAX_BLOCK_K),
        SKIP_PADDING=pairs is not None, ROW_SS=sumsq.shape[0] if sumsq is not None else 0,
        RECIPROCAL=x.is_cuda, HW_ROUND=hardware_rounds_e4m3(x.device),
        num_warps=4, **pdl_options(x.device),
    )
    return q, scale
