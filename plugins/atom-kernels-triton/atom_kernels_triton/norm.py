"""RMSNorm and fused residual-add + RMSNorm: one pass over each row, fp32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels_triton.pdl import pdl_options, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, sum_ptr, rows, n, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # ROWS rows per program: short rows (Qwen3's per-head q/k norm, head_dim 128) would
    # otherwise leave most of each program idle.
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (row[:, None] < rows) & (cols[None, :] < n)
    x = tl.load(x_ptr + row[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the model dtype first, as the native op does, so the residual
        # stream is bit-identical to the one it would carry.
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row[:, None] * n + cols[None, :], s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    y = xf * rstd[:, None] * w[None, :]
    tl.store(out_ptr + row[:, None] * n + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    x2 = _rows(x)
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    block = triton.next_power_of_2(n)
    per_row = max(1, min(16, 2048 // block))
    _rms_norm_kernel[(triton.cdiv(rows, per_row),)](
        x2, x2.stride(0), r2, r2.stride(0), weight, out, summed, rows, n, eps,
        HAS_RESIDUAL=residual is not None, ROWS=per_row, BLOCK=block,
        num_warps=8 if block >= 4096 else 4, **pdl_options(x.device),
    )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), like the native op."""
    return _launch(x, residual, weight, eps)
