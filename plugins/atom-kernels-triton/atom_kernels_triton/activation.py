"""SiLU-and-mul: the gated MLP's activation, one read of gate_up and one write."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels_triton.pdl import pdl_options, pdl_wait


@triton.jit
def silu_and_mul_tile(ptrs, mask, d):
    """silu(gate) * up for the gate tile at ``ptrs`` and the up tile ``d`` further on, in the
    model dtype, rounded as ``silu_and_mul`` rounds it (the kernels that fuse the activation
    into their loads share these bits). 0 where masked (silu(0) * 0)."""
    a = tl.load(ptrs, mask=mask, other=0.0)
    b = tl.load(ptrs + d, mask=mask, other=0.0)
    af = a.to(tl.float32)
    # silu rounded to the model dtype before the multiply, as F.silu(a) * b does.
    s = (af / (1.0 + tl.exp(-af))).to(a.dtype)
    return (s.to(tl.float32) * b.to(tl.float32)).to(a.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, out_ptr, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    y = silu_and_mul_tile(x_ptr + row * x_stride + cols, mask, d)
    tl.store(out_ptr + row * d + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2d."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, x2.stride(0), out, d, BLOCK=block, **pdl_options(x.device),
    )
    return out.view(*x.shape[:-1], d)
