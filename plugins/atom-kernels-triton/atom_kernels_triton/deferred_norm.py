"""The Triton side of ``atom_core.ops.deferred_norm``: what a producer stores and a reader
computes, shared by the GEMV, its split-K reduce, the MoE kernels and the top-k kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_rms_scale(ss_ptr, rows, row_ok, M, K, eps, PARTS: tl.constexpr):
    """1/rms of each row from PARTS partial sums of squares ([PARTS, M]), added in order."""
    ss = tl.zeros(rows.shape, tl.float32)
    for s in tl.static_range(PARTS):
        ss += tl.load(ss_ptr + s * M + rows, mask=row_ok, other=0.0)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def add_norm_store(y, res_ptrs, nw_ptrs, sum_ptrs, scaled_ptrs, mask, axis: tl.constexpr):
    """A ``DeferredNorm``'s share of a tile of the output y (model dtype): h = y + residual,
    rounded as ``fused_add_rms_norm`` rounds it, and h * weight stored; returns the tile's
    sums of h * h along ``axis`` (its columns), for the caller to store."""
    h = (y.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(y.dtype)
    tl.store(sum_ptrs, h, mask=mask)
    hf = h.to(tl.float32)
    tl.store(scaled_ptrs, (hf * tl.load(nw_ptrs, mask=mask, other=0.0).to(tl.float32)).to(y.dtype),
             mask=mask)
    return tl.sum(tl.where(mask, hf * hf, 0.0), axis=axis)
