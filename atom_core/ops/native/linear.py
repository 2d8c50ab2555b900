"""The ``linear`` op's reference: cuBLAS / the CPU BLAS; an ``Fp8Weight`` through the fp8
reference (``atom_core.quant.fp8``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.ops.deferred_norm import AddNorm, DeferredNorm, normed
from atom_core.ops.native.norm import fused_add_rms_norm, rms_norm, rms_norm_quant_fp8
from atom_core.quant.fp8 import Fp8Weight, fp8_linear, uses_w8a8, w8a8_matmul


def rows_of(x: torch.Tensor | DeferredNorm) -> torch.Tensor:
    """x itself, or a ``DeferredNorm``'s normed rows: the reference finishes the norm."""
    return normed(x, rms_norm) if isinstance(x, DeferredNorm) else x


def promote(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x in fp32 where the weight is fp32 (the MoE router keeps an fp32 weight and takes the
    model-dtype hidden states); any other mismatch is left for F.linear to refuse."""
    return x.float() if weight.dtype == torch.float32 else x


def plain_linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear``, or ``fp8_linear`` for an ``Fp8Weight``."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    return F.linear(promote(x, weight), weight, bias)


def linear(
    x: torch.Tensor | DeferredNorm, weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None, *, add_norm: AddNorm | None = None,
) -> torch.Tensor:
    """``F.linear``, an fp32 weight promoting x (``promote``), an ``Fp8Weight`` through the
    fp8 reference. The reference never defers a norm: ``add_norm`` is declined (the caller
    adds and norms), a ``DeferredNorm`` x normed."""
    return plain_linear(rows_of(x), weight, bias)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's norm and first projection: (linear(rms_norm(h), weight, bias), h)
    for h = x + residual, or h = x where residual is None. An ``Fp8Weight`` at W8A8 rows
    takes the normed rows quantized from fp32 (``rms_norm_quant_fp8``): the quantization
    the product would apply, less the rounding of the rows to the model dtype before it."""
    if isinstance(weight, Fp8Weight) and uses_w8a8(x, weight):
        xq, x_scale, summed = rms_norm_quant_fp8(x, residual, norm_weight, eps)
        return w8a8_matmul(xq, x_scale, weight, bias, x.dtype), summed
    if residual is None:
        return plain_linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed_rows, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return plain_linear(normed_rows, weight, bias), summed
