"""RMSNorm (after an optional residual add) and per-row fp8 quantization in one kernel: the
``rms_norm_quant_fp8`` op, and ``rms_norm_linear``'s W8A8 path built on it.

A pre-norm block's first projection (qkv, gate_up) on an ``Fp8Weight`` takes, from its
``w8a8_min_rows`` on, its input rows quantized per row. As two ops, the norm writes its rows
in the model dtype and the quantization kernel (fp8_quant.py) reads them back; here the
program that norms a row quantizes the fp32 values it holds: one launch fewer, 4 bytes a
value less traffic (the bf16 write and read), and one rounding fewer (the normalised values
never stop in bf16).

The arithmetic is ``atom_core.ops.native.norm.rms_norm_quant_fp8``'s: h = x + residual
rounded to x's dtype (written: the residual stream's next value), n = h * rsqrt(mean(h^2)
+ eps) * g in fp32, and fp8_quant.py's quantization of n (scale = max(amax / 448,
MIN_SCALE), the product with its correctly rounded reciprocal, saturating round to nearest
even, signed zeros kept). The mean and the rsqrt are torch's on the device it runs on: the
sum over K then a division by K and 1 / sqrt on CPU (the interpreter), the product with 1/K
and rsqrtf on CUDA. Only the order of the sum of squares differs from the reference, so a
row whose sum is exact in any order comes out bit for bit, and any other within a few fp32
ulps of 1/rms: its scale within as many, and a value one e4m3 step off where n / scale lies
that close to a rounding boundary.

One program per row, as fp8_quant.py: a row up to MAX_ONE_TILE wide is one tile held in
registers from the load to the store; wider rows take three passes over K (the sum of
squares, the amax, the quantization), the later two recomputing h from x and the residual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.ops.native.norm import rms_norm_quant_fp8 as native_rms_norm_quant_fp8
from atom_core.quant.fp8 import FP8_DTYPE, Fp8Weight, uses_w8a8, w8a8_matmul
from atom_kernels_triton import fp8_gemm
from atom_kernels_triton.fp8_quant import (
    MAX_ONE_TILE,
    hardware_rounds_e4m3,
    quantize_e4m3,
    row_scale,
)
from atom_kernels_triton.pdl import pdl_options, pdl_wait

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _load_h(x_row, r_row, h_row, offs, mask, HAS_RES: tl.constexpr, STORE: tl.constexpr):
    """h = x + residual rounded to x's dtype, as the native op forms it, in fp32."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if STORE:
            tl.store(h_row + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, x_stride, r_ptr, r_stride, w_ptr, h_ptr, q_ptr, s_ptr, K, eps,
    HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
    TORCH_CUDA: tl.constexpr, HW_ROUND: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    r_row = r_ptr + row * r_stride
    h_row = h_ptr + row * K
    q_row = q_ptr + row * K
    ks = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        h = _load_h(x_row, r_row, h_row, ks, ks < K, HAS_RES, True)
        ss = tl.sum(h * h, axis=0)
    else:
        ss_k = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            hk = _load_h(x_row, r_row, h_row, k0 + ks, k0 + ks < K, HAS_RES, True)
            ss_k += hk * hk
        ss = tl.sum(ss_k, axis=0)
    k_f = K.to(tl.float32)
    if TORCH_CUDA:  # torch's CUDA mean (a product with 1/K) and rsqrt (rsqrtf)
        rstd = tl.math.rsqrt(ss * tl.math.div_rn(1.0, k_f) + eps)
    else:
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, k_f) + eps))
    if ONE_TILE:
        w = tl.load(w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        n = h * rstd * w
        amax = tl.max(tl.abs(n), axis=0)
    else:
        amax_k = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            hk = _load_h(x_row, r_row, h_row, kk, kk < K, HAS_RES, False)
            wk = tl.load(w_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            amax_k = tl.maximum(amax_k, tl.abs(hk * rstd * wk))
        amax = tl.max(amax_k, axis=0)
    scale = row_scale(amax, TORCH_CUDA)
    tl.store(s_ptr + row, scale)
    inv = tl.math.div_rn(1.0, scale)
    if ONE_TILE:
        q = quantize_e4m3(n, inv, HW_ROUND)
        tl.store(q_row + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            hk = _load_h(x_row, r_row, h_row, kk, kk < K, HAS_RES, False)
            wk = tl.load(w_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            q = quantize_e4m3(hk * rstd * wk, inv, HW_ROUND)
            tl.store(q_row + kk, q.to(q_ptr.dtype.element_ty), mask=kk < K)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def takes(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the kernel serves this call (else the native op does): x in bf16, fp16 or
    fp32 with rows of at least one value, the residual x's shape and dtype, the norm
    weight [K] contiguous."""
    return (
        x.dim() > 0
        and x.shape[-1] > 0
        and x.dtype in X_DTYPES
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
        and weight.shape == (x.shape[-1],)
        and weight.is_contiguous()
    )


def rms_norm_quant_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 rows [..., K], fp32 scales [...], h) for h = x + residual (x where residual is
    None), the native op's contract. ``block_k`` overrides the tile (tests take the
    three-pass form with it)."""
    if not takes(x, residual, weight):
        return native_rms_norm_quant_fp8(x, residual, weight, eps)
    k = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    summed = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else x2
    if m > 0:
        r2 = _rows(residual) if residual is not None else x2
        if block_k is None:
            block_k = min(triton.next_power_of_2(k), MAX_ONE_TILE)
        _rms_norm_quant_kernel[(m,)](
            x2, x2.stride(0), r2, r2.stride(0), weight, summed, q, scale, k, eps,
            HAS_RES=residual is not None, BLOCK_K=block_k, ONE_TILE=block_k >= k,
            TORCH_CUDA=x.is_cuda, HW_ROUND=hardware_rounds_e4m3(x.device),
            num_warps=min(16, max(4, block_k // 1024)),
            # torch rounds the mean before it adds eps: no fused multiply-add there.
            enable_fp_fusion=False, **pdl_options(x.device),
        )
    return (q.view(x.shape), scale.view(x.shape[:-1]),
            summed.view(x.shape) if residual is not None else x)


def takes_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
) -> bool:
    """Whether ``rms_norm_linear`` goes through ``rms_norm_w8a8_linear``: an ``Fp8Weight``
    [N, K] at W8A8 rows, and a call the kernel takes."""
    return (
        isinstance(weight, Fp8Weight)
        and weight.qweight.dim() == 2
        and weight.qweight.shape[1] == x.shape[-1]
        and uses_w8a8(x, weight)
        and takes(x, residual, norm_weight)
    )


def rms_norm_w8a8_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: Fp8Weight, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(h)), h) on the W8A8 path (``takes_linear`` calls): the rows normed and
    quantized by one kernel, then the W8A8 product as fp8_gemm.w8a8_linear runs it (the
    reference product where that does not take the call: N or K off a multiple of 16)."""
    q, x_scale, summed = rms_norm_quant_fp8(x, residual, norm_weight, eps)
    n, k = weight.qweight.shape
    q2, s2 = q.view(-1, k), x_scale.view(-1)
    if fp8_gemm.w8a8_ok(x, weight, bias):
        out = fp8_gemm.w8a8_matmul(q2, s2, weight, bias, x.dtype)
    else:
        out = w8a8_matmul(q2, s2, weight, bias, x.dtype)
    return out.view(*x.shape[:-1], n), summed
