"""MXFP4 weights (OCP microscaling FP4), the format gpt-oss ships its experts in: the
layout, and the reference arithmetic every kernel is tested against.

A weight [..., N, K] is ``blocks`` uint8 [..., N, K/2], two e2m1 values per byte (the
even-indexed element in the low nibble), and ``scales`` uint8 [..., N, K/32], each an e8m0
exponent: 32 consecutive elements of a row share the factor 2**(scale - 127). A checkpoint
names them ``<weight>_blocks`` ([..., N, K/32, 16]) and ``<weight>_scales``, as
transformers' integrations/mxfp4.py reads them.

Which format the activations take follows the blog's adaptive rule: in a step of fewer
than ``bf16_bound`` tokens they stay in the model dtype and the weight is dequantized as it
is read (the product is bound by reading the 4-bit weight, and quantizing a few rows would
cost more than it saves); from the bound on, a kernel that gains from it quantizes them
too. The bound is the blog's default, 256, or the GPTOSS_SWIGLU_MXFP4_BF16_BOUND
environment variable. The reference has no quantized-activation path: it dequantizes to
the activations' dtype at every size, so on CPU the bound changes nothing; the Triton
kernel (atom-kernels-triton) is weight-only at every size too, so far.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from atom_core.errors import ConfigError

BLOCK = 32  # elements sharing one scale
SCALE_BIAS = 127  # e8m0: factor 2 ** (scale - 127)
# The 16 e2m1 codes' values: sign bit 3, then two exponent bits and one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BF16_BOUND_ENV = "GPTOSS_SWIGLU_MXFP4_BF16_BOUND"
DEFAULT_BF16_BOUND = 256


def bf16_bound() -> int:
    """The token count from which activations may be quantized: the environment's
    GPTOSS_SWIGLU_MXFP4_BF16_BOUND, else 256."""
    raw = os.environ.get(BF16_BOUND_ENV, "").strip()
    if not raw:
        return DEFAULT_BF16_BOUND
    try:
        bound = int(raw)
    except ValueError:
        bound = -1
    if bound < 1:
        raise ConfigError(f"{BF16_BOUND_ENV} must be a positive token count, got {raw!r}")
    return bound


class Mxfp4Weight(NamedTuple):
    """A weight [..., N, K] as MXFP4 ``blocks`` [..., N, K/2] and ``scales`` [..., N, K/32]
    (module docstring); ``bf16_bound``: the step size from which a kernel may quantize the
    activations."""

    blocks: torch.Tensor
    scales: torch.Tensor
    bf16_bound: int = DEFAULT_BF16_BOUND

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.blocks.shape[:-1], self.blocks.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.blocks, self.scales, dtype)

    def expert(self, e: int) -> Mxfp4Weight:
        """Expert ``e``'s [N, K] weight of a stack [E, N, K]."""
        return Mxfp4Weight(self.blocks[e], self.scales[e], self.bf16_bound)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [..., N, K] in ``dtype``: exact in fp32 and bf16 (two significant bits,
    exponents within theirs), scaled in fp32."""
    lut = torch.tensor(FP4_VALUES, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # low nibble first
    values = lut[codes].view(*scales.shape, BLOCK)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``weight`` [..., N, K] (K a multiple of 32): each group of 32
    scaled by the smallest power of two that brings its largest magnitude within e2m1's
    6.0, each value rounded to the nearest e2m1 value."""
    *lead, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs rows of a multiple of {BLOCK} elements, got {k}")
    groups = weight.float().reshape(*lead, k // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponents)[..., None]
    lut = torch.tensor(FP4_VALUES, device=weight.device)
    codes = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)
    codes = codes.reshape(*lead, k)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + SCALE_BIAS).to(torch.uint8)
