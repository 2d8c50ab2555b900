"""FP8 (e4m3) weights and activations: the format, and the reference arithmetic every
kernel is tested against.

A linear's or an expert stack's weight quantized online (``--quantization fp8``) is an
``Fp8Weight``: e4m3 values and one fp32 scale per output row (the weight is
``qweight * scale[..., None]``). The op that multiplies by it picks the activations' format
from the number of rows it is given, as the blog's adaptive recipe does: below
``w8a8_min_rows`` the activations stay in the model dtype and the kernel dequantizes the
weight as it loads it (the product is bound by reading the weight, which fp8 halves, and a
pass quantizing a few rows would cost more than it saves); from there on the activations
are quantized per row (one dynamic scale per token) and the product runs on fp8 tensor
cores (W8A8).

The reference ops here compute in fp32 from the dequantized operands; a kernel matches them
up to the order of its fp32 sums and the rounding of its output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# The smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# The blog's crossover (its bf16/MXFP4 bound defaults to 256 tokens).
DEFAULT_W8A8_MIN_ROWS = 256
# The layer kinds --fp8-layers chooses from (atom_core.quant.online says which is which).
LAYER_KINDS = ("attention", "mlp", "experts", "lm_head")
# Each kind's crossover where --fp8-w8a8-min-rows is not given. Dense projections: from 64
# rows the W8A8 GEMM beat the weight-only one on Qwen3-8B's four projections together
# (bench/fp8_linear.py, H200; bench/RESULTS.md). Experts: the blog's 256; below it the
# weight-only fused-MoE kernel beat bf16 at 32 tokens, at and above it W8A8 did.
KIND_W8A8_MIN_ROWS = {"attention": 64, "mlp": 64, "lm_head": 64, "experts": 256}


def check_options(kinds: list[str] | tuple[str, ...], w8a8_min_rows: int | None) -> None:
    """ValueError naming what is wrong with --fp8-layers / --fp8-w8a8-min-rows."""
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"--fp8-layers: unknown kind {', '.join(unknown)}; "
                         f"kinds: {', '.join(LAYER_KINDS)}")
    if w8a8_min_rows is not None and w8a8_min_rows < 1:
        raise ValueError(f"--fp8-w8a8-min-rows must be >= 1, got {w8a8_min_rows}")


class Fp8Weight(NamedTuple):
    """A weight [..., N, K] as e4m3 ``qweight`` and fp32 ``scale`` [..., N]: W = qweight *
    scale[..., None]. Inputs of ``w8a8_min_rows`` rows or more are quantized per row (W8A8);
    fewer are multiplied in their own dtype by the dequantized weight."""

    qweight: torch.Tensor
    scale: torch.Tensor
    w8a8_min_rows: int = DEFAULT_W8A8_MIN_ROWS

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scale[..., None]).to(dtype)

    def expert(self, e: int) -> Fp8Weight:
        """Expert ``e``'s [N, K] weight of a stack [E, N, K]."""
        return Fp8Weight(self.qweight[e], self.scale[e], self.w8a8_min_rows)


class RowsOnLoad(NamedTuple):
    """What an e4m3 weight allocated before loading needs to take the checkpoint's rows
    (``layers.linear.store_rows``): the fp32 ``scale`` [..., N] its rows' scales go to, and
    the model ``dtype`` each row is rounded to first, as a weight loaded in that dtype and
    quantized afterwards would have been."""

    scale: torch.Tensor
    dtype: torch.dtype


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales [...]) of ``t`` [..., K] with one scale per row: each row's
    largest magnitude maps to e4m3's largest finite value (448). The values are multiplied
    by the scale's fp32 reciprocal (one division a row, not one a value: what a kernel can
    afford), saturated, and rounded to the nearest e4m3 value, ties to even."""
    tf = t.float()
    scale = (tf.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (tf * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight(weight: torch.Tensor, w8a8_min_rows: int = DEFAULT_W8A8_MIN_ROWS
                    ) -> Fp8Weight:
    """``weight`` [..., N, K] quantized per output row (per channel)."""
    q, scale = quantize_rows(weight)
    return Fp8Weight(q.contiguous(), scale.contiguous(), w8a8_min_rows)


def uses_w8a8(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether a product of ``x``'s rows with ``weight`` quantizes the activations."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return rows >= weight.w8a8_min_rows


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None, *,
               w8a8: bool | None = None) -> torch.Tensor:
    """x @ W^T + bias in x's dtype, W an ``Fp8Weight`` [N, K]: weight-only below
    ``w8a8_min_rows`` rows (x as it is), W8A8 from there on (x quantized per row).
    ``w8a8`` decides instead where the rows are a part of a larger step (an expert's share
    of the step's tokens: the step's size picks the format)."""
    if uses_w8a8(x, weight) if w8a8 is None else w8a8:
        xq, x_scale = quantize_rows(x)
        return w8a8_matmul(xq, x_scale, weight, bias, x.dtype)
    return _scaled_out(x.float() @ weight.qweight.float().T, weight, bias, x.dtype)


def w8a8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: Fp8Weight,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale[..., None]) @ W^T + bias in ``out_dtype``: the product of rows already
    quantized per row (e4m3 ``xq`` [..., K], fp32 ``x_scale`` [...]), the reference of
    ``torch._scaled_mm`` with row-wise scales."""
    acc = (xq.float() @ weight.qweight.float().T) * x_scale[..., None]
    return _scaled_out(acc, weight, bias, out_dtype)


def _scaled_out(acc: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    out = acc * weight.scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
