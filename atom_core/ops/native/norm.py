"""RMSNorm, plain and fused with the residual add, computed in fp32; and the norm fused with
the per-row fp8 quantization of a W8A8 product's input."""

from __future__ import annotations

import torch

from atom_core.quant.fp8 import quantize_rows


def _normed_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * weight.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _normed_fp32(x, weight, eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def rms_norm_quant_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 rows [..., K], fp32 scales [...], h) for h = x + residual (x where residual is
    None): rms_norm(h) quantized per row (``quantize_rows``) from its fp32 values, never
    rounded to the model dtype. The input of a W8A8 product that reads a norm's output."""
    summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    q, scale = quantize_rows(_normed_fp32(summed, weight, eps))
    return q, scale, summed
