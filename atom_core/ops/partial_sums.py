"""``PartialSums``: a projection's output left as fp32 partial products, to be added up by
the op that reads it.

A split-K GEMV (ops/triton/gemv.py) writes S partial products of its output and needs a
second kernel to sum them. Where the next op is the block's residual add + RMSNorm, the
sum can be that kernel's first step instead: a kernel fewer each time. The
``linear_unreduced`` op returns one where its kernel split K (a tensor otherwise), and
``add_rms_norm_partials`` takes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PartialSums(NamedTuple):
    """out = (parts[0] + ... + parts[S-1] + bias).to(dtype), summed in split order in fp32."""

    parts: torch.Tensor  # [S, M, N] fp32, rows of unit column stride
    bias: torch.Tensor | None  # [N]
    dtype: torch.dtype  # the output's
    shape: torch.Size  # the output's: [..., N] with M rows

    def reduce(self) -> torch.Tensor:
        """The output tensor, summed as the fused kernels sum it (the reference)."""
        acc = self.parts[0].clone()
        for part in self.parts[1:]:
            acc += part
        if self.bias is not None:
            acc += self.bias.float()
        return acc.to(self.dtype).view(self.shape)
