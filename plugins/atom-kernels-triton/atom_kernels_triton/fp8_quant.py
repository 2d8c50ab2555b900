"""Per-row dynamic FP8 quantization of activations: x [M, K] -> (e4m3 [M, K], fp32 [M]).

The W8A8 path of an ``Fp8Weight`` product (fp8_gemm.py) quantizes its input rows here
before the fp8 tensor-core GEMM. The arithmetic is ``atom_core.quant.fp8.quantize_rows``'s,
bit for bit on the device it runs on: scale = max(amax / 448, MIN_SCALE) and
q = clamp(x * (1 / scale), -448, 448) rounded to the nearest e4m3 value, ties to even, the
reciprocal correctly rounded (``div_rn``: a plain ``/`` compiles to an approximate
division on NVIDIA GPUs). amax / 448 is what torch computes for a tensor divided by a
number: a division on CPU, on CUDA a product with the fp32 reciprocal of the number.

Each value costs a product, a clamp and a conversion. Where the device converts to e4m3
rounding to nearest even (NVIDIA from sm_89: ``cvt.rn.satfinite``), the store's conversion
rounds; elsewhere (the interpreter, whose conversion rounds otherwise) ``round_to_e4m3``
does it in integer arithmetic first, about 15 more operations a value. A division a value
and that rounding made these kernels bound by arithmetic rather than memory on Hopper
(bench/fp8_quant.py; bench/RESULTS.md).

One program per row: a row of the model's width (a few thousand values) is one tile held in
registers between the max and the quantizing pass; wider rows take two passes over K. The
gated form quantizes a gated MLP's activation, silu(gate) * up, formed as it is loaded: the
down projection's W8A8 input without the activation's own kernel and its rows' round trip
through memory.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_core.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from atom_kernels_triton.activation import silu_and_mul_tile
from atom_kernels_triton.pdl import pdl_options, pdl_wait

# Rows up to this wide stay in registers between the two passes.
MAX_ONE_TILE = 16384
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
# Below 2^-6 e4m3 is subnormal, with a fixed quantum of 2^-9; adding 1.5 * 2^14, whose fp32
# quantum is 2^-9, rounds to it (to nearest, ties to even) as the fp32 add rounds.
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_SUBNORMAL_SHIFT = tl.constexpr(1.5 * 2.0**14)


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32,
    sign kept (zeros too). The conversion to e4m3 that follows is then exact: torch's
    rounding, on every backend (the interpreter's conversion rounds otherwise)."""
    bits = v.to(tl.uint32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits; a carry moves into the exponent.
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    tiny = (tl.abs(v) + _SUBNORMAL_SHIFT) - _SUBNORMAL_SHIFT
    tiny_bits = tiny.to(tl.uint32, bitcast=True) | (bits & 0x80000000)
    out = tl.where(tl.abs(v) < _E4M3_MIN_NORMAL, tiny_bits, normal)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def row_scale(amax, RECIPROCAL: tl.constexpr):
    """A row's scale from its largest magnitude, as ``quantize_rows`` computes it: amax / 448
    (``RECIPROCAL``: as torch's CUDA kernel divides a tensor by a number), at least
    MIN_SCALE."""
    if RECIPROCAL:
        scale = amax * _INV_FP8_MAX
    else:
        scale = tl.math.div_rn(amax, _FP8_MAX)
    return tl.maximum(scale, _MIN_SCALE)


@triton.jit
def quantize_e4m3(x, inv_scale, HW_ROUND: tl.constexpr):
    """x * inv_scale (fp32), saturated to +-448, for a conversion to e4m3 that rounds as
    ``quantize_rows`` does (signed zeros kept): the device's (``HW_ROUND``), or an exact one
    after ``round_to_e4m3``."""
    q = tl.clamp(x * inv_scale, -_FP8_MAX, _FP8_MAX)
    if not HW_ROUND:
        q = round_to_e4m3(q)
    return q


def hardware_rounds_e4m3(device: torch.device) -> bool:
    """Whether Triton's fp32 -> e4m3 conversion on ``device`` rounds to nearest even and
    saturates (``cvt.rn.satfinite``, NVIDIA sm_89 and later), so kernels need not round."""
    return device.type == "cuda" and torch.version.hip is None and _capability(device) >= (8, 9)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@triton.jit
def _row_tile(x_row, kk, mask, K, GATED: tl.constexpr):
    """The row's values at ``kk`` in fp32; GATED: silu(gate) * up of a gate | up row, as
    ``silu_and_mul`` rounds it to the model dtype."""
    if GATED:
        return silu_and_mul_tile(x_row + kk, mask, K).to(tl.float32)
    else:
        return tl.load(x_row + kk, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, x_stride, q_ptr, s_ptr, K, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
    RECIPROCAL: tl.constexpr, HW_ROUND: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    q_row = q_ptr + row * K
    ks = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        x = _row_tile(x_row, ks, ks < K, K, GATED)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        amax_k = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            amax_k = tl.maximum(amax_k, tl.abs(_row_tile(x_row, kk, kk < K, K, GATED)))
        amax = tl.max(amax_k, axis=0)
    scale = row_scale(amax, RECIPROCAL)
    tl.store(s_ptr + row, scale)
    inv = tl.math.div_rn(1.0, scale)
    if ONE_TILE:
        q = quantize_e4m3(x, inv, HW_ROUND)
        tl.store(q_row + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            q = quantize_e4m3(_row_tile(x_row, kk, kk < K, K, GATED), inv, HW_ROUND)
            tl.store(q_row + kk, q.to(q_ptr.dtype.element_ty), mask=kk < K)


def quantize_rows(x: torch.Tensor, block_k: int | None = None, *, gated: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M]) of x's rows (x [..., K] flattened to [M, K]), as
    ``atom_core.quant.fp8.quantize_rows`` computes them. ``gated``: x is a gated MLP's
    gate | up [..., 2K], and the rows quantized are ``silu_and_mul(x)``'s, bit for bit,
    without writing them out. ``block_k`` overrides the tile (tests take the two-pass form
    with it)."""
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    if block_k is None:
        block_k = min(triton.next_power_of_2(k), MAX_ONE_TILE)
    # About 32 values a thread: one program streams a whole row.
    num_warps = min(16, max(4, block_k // 1024))
    _quantize_rows_kernel[(m,)](
        x2, x2.stride(0), q, scale, k, BLOCK_K=block_k, ONE_TILE=block_k >= k,
        RECIPROCAL=x.is_cuda, HW_ROUND=hardware_rounds_e4m3(x.device), GATED=gated,
        num_warps=num_warps, **pdl_options(x.device),
    )
    return q, scale
