"""The ``linear`` op's products with an ``Fp8Weight`` past the GEMV's rows (gemv.py).

- ``weight_only_linear``: from gemv_config.MAX_ROWS rows up to the weight's
  ``w8a8_min_rows``, x stays in its dtype (bf16/fp16) and W is converted from e4m3 as it is
  loaded: a tiled GEMM over M and N whose W tiles go to x's dtype before ``tl.dot``, and
  whose accumulator is multiplied by the per-output-column scale at the end. It still reads
  W once: the M tiles of one N tile are neighbours in launch order, so all but the first
  find W's tile in L2. Few rows run with W x^T (SWAP: W's tile is the product's M side, the
  rows its N side, as gemv.py's 32-row tile) and, where the tiles alone would leave SMs idle,
  split along K, the fp32 partial sums added in a fixed order by a second kernel.
- ``w8a8_linear``: from ``w8a8_min_rows`` rows on, x is quantized per row (fp8_quant.py)
  and the product runs on fp8 tensor cores with row-wise scales (x's per row, W's per
  column), applied to the fp32 accumulator: in ``torch._scaled_mm``, or, for the shapes
  and row counts the device's table (``W8A8_OP``) lists, in the same Triton GEMM with both
  operands e4m3 (W x^T, split along K, so that a few rows still keep every SM reading W,
  where _scaled_mm's tiles fill few SMs). ``bench/fp8_linear.py --sweep`` writes the table
  where the Triton GEMM won; CPU tensors (the interpreter) always take it.

Both match ``atom_core.quant.fp8.fp8_linear`` up to the order of their fp32 sums and the
rounding of the output; ``torch._scaled_mm`` also up to its fast accumulation
(``SCALED_MM_FAST_ACCUM``).
"""

from __future__ import annotations

import functools
from typing import TypedDict

import torch
import triton
import triton.language as tl

from atom_core.quant.fp8 import FP8_DTYPE, Fp8Weight
from atom_kernels_triton import tuning
from atom_kernels_triton.fp8_quant import quantize_rows
from atom_kernels_triton.occupancy import device_limits
from atom_kernels_triton.pdl import pdl_options, pdl_wait

X_DTYPES = (torch.bfloat16, torch.float16)
H200_SMS = 132  # what the interpreter (CPU tensors) sizes grids for
# The W8A8 GEMM's table (tuning.py): (N, K) -> row bucket (16, 32, 64, 128) -> tiles, or
# null where torch._scaled_mm was at least as fast. Past the largest bucket, _scaled_mm.
W8A8_OP = "fp8_w8a8"
W8A8_GEMM_MAX_ROWS = 128
# torch._scaled_mm sums all of K in the tensor cores' accumulator (narrower than fp32 on
# Hopper), without cuBLAS's periodic promotion to fp32. The error stays far below the e4m3
# rounding of x and W that any W8A8 product carries (tests/gpu/test_fp8_linear_gpu.py), and
# it takes 5-20% off every projection of Qwen3-8B from 512 to 16,384 rows (the prefill
# steps' GEMMs; bench/fp8_linear.py, bench/RESULTS.md). vLLM's CUTLASS fp8 kernels
# accumulate the same way, and so does the Triton W8A8 GEMM below: on sm_90 Triton's e4m3
# tl.dot never promotes unless given max_num_imprecise_acc (fused_moe.py's W8A8 does).
SCALED_MM_FAST_ACCUM = True


class GemmConfig(TypedDict):
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int
    SWAP: bool
    num_warps: int
    num_stages: int


def weight_ok(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, k_factor: int = 1
) -> bool:
    """Whether the Triton kernels take x [..., K * k_factor] with this weight and bias: a
    contiguous e4m3 [N, K] with fp32 scales [N], x in bf16 or fp16 and the bias in x's dtype
    (the output's)."""
    q, s = weight.qweight, weight.scale
    return (
        x.dim() > 0
        and x.shape[-1] > 0
        and x.dtype in X_DTYPES
        and q.dim() == 2
        and q.dtype == FP8_DTYPE
        and q.is_contiguous()
        and q.shape[1] * k_factor == x.shape[-1]
        and s.shape == (q.shape[0],)
        and s.dtype == torch.float32
        and s.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.shape == (q.shape[0],)
                              and bias.is_contiguous()))
    )


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, x_stride, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
    X_FP8: tl.constexpr, PDL: tl.constexpr,
):
    # The M tiles of one N tile are consecutive programs: W's tile comes from HBM once.
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n = tl.program_id(0) // num_m
    pid_m = tl.program_id(0) % num_m
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    # Features past N re-read the last one (W's loads stay unmasked; their results are never
    # stored). Rows past M are masked instead: pointed at row M-1, every program would
    # request that one row's lines once per missing row each K step.
    w_tile = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    ks = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pdl_wait(PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + ks
        if EVEN_K:
            w = tl.load(w_tile + kk[None, :])
            a = tl.load(x_tile + kk[None, :], mask=row_ok[:, None], other=0.0)
        else:
            w = tl.load(w_tile + kk[None, :], mask=kk[None, :] < K, other=0.0)
            a = tl.load(x_tile + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K),
                        other=0.0)
        if not X_FP8:
            w = w.to(a.dtype)  # e4m3 values are exact in bf16 and fp16
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    scale = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    # Index the output as the accumulator is laid out, [N, M] where SWAP.
    if X_FP8:  # x's per-row scales, applied before W's as the reference applies them
        x_scale = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
        if SWAP:
            acc *= x_scale[None, :]
        else:
            acc *= x_scale[:, None]
    if SWAP:
        acc *= scale[:, None]
        offs = rows[None, :].to(tl.int64) * N + cols[:, None]
        mask = row_ok[None, :] & col_ok[:, None]
    else:
        acc *= scale[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            if SWAP:
                acc += bias[:, None]
            else:
                acc += bias[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    parts = part_ptr + offs
    for _ in tl.static_range(SPLIT_K):  # a fixed order: the same sum every run
        acc += tl.load(parts, mask=ok, other=0.0)
        parts += MN  # a pointer step: no 32-bit product of the split and M * N
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return device_limits(device).sms


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_config(m: int, n: int, k: int, num_sms: int = H200_SMS) -> GemmConfig:
    """Tiles from the shape alone, after ``bench/fp8_linear.py --sweep`` on an H200 (Qwen3-8B's
    projections at 32 to 200 rows). One M tile holds up to 64 rows: 32 rows as x W^T, 64
    as W x^T (SWAP), W's tile 64 features wide; more rows take 64-row tiles against 128
    features, BLOCK_K 64 (the W tile, converted to x's dtype in registers, grows with it).
    SPLIT_K 4 where the tiles alone give under two programs per SM, else 2: up to a few
    hundred rows the product is bound by reading W, and every split won in the sweep; the
    32-row tile then takes BLOCK_K 256 (more bytes in flight a program: o_proj and
    down_proj took 25 and 34 % less time at 32 rows). Each split keeps >= 4 BLOCK_K
    chunks."""
    tiles = _cdiv(n, 64 if m <= 64 else 128) * _cdiv(m, 64)
    split_k = 4 if tiles < 2 * num_sms else 2
    if m <= 64:
        block_m = max(16, 1 << max(0, m - 1).bit_length())
        block_n, swap = 64, block_m == 64
        block_k = 256 if split_k == 4 and not swap else 128
    else:
        block_m, block_n, block_k, swap = 64, 128, 64, False
    while split_k > 1 and _cdiv(k, block_k) < 4 * split_k:
        split_k //= 2
    return GemmConfig(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                      SWAP=swap, num_warps=4, num_stages=4)


def w8a8_config(m: int, n: int, k: int, num_sms: int = H200_SMS) -> GemmConfig:
    """Tiles of the W8A8 GEMM (both operands e4m3) from the shape alone (CPU tensors, and
    the sweep's first candidate): W's tile on the tensor cores' M side (SWAP), up to 64
    rows in one tile beside it; BLOCK_N 128 where that alone gives a program per SM, else
    64; BLOCK_K 256 (an e4m3 tile is half a 16-bit one's bytes); K split as
    ``default_config`` splits it."""
    block_m = min(64, max(16, 1 << max(0, m - 1).bit_length()))
    m_tiles = _cdiv(m, block_m)
    block_n = 128 if _cdiv(n, 128) * m_tiles >= num_sms else 64
    block_k = max(32, min(256, 1 << max(0, k - 1).bit_length()))
    split_k = 4 if _cdiv(n, block_n) * m_tiles < 2 * num_sms else 2
    while split_k > 1 and _cdiv(k, block_k) < 4 * split_k:
        split_k //= 2
    return GemmConfig(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                      SWAP=True, num_warps=4, num_stages=4)


def _gemm(x2: torch.Tensor, x_scale: torch.Tensor | None, weight: Fp8Weight,
          bias: torch.Tensor | None, out_dtype: torch.dtype, config: GemmConfig) -> torch.Tensor:
    """The [M, N] product of the rows x2 [M, K] (16-bit, or e4m3 with ``x_scale`` [M]) and
    W, in ``out_dtype``."""
    q = weight.qweight
    n, k = q.shape
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    if m == 0:
        return out
    block_k = config["BLOCK_K"]
    # Each split covers whole BLOCK_K chunks; splits that would start past K are dropped.
    k_per_split = _cdiv(_cdiv(k, block_k), config["SPLIT_K"]) * block_k
    split_k = _cdiv(k, k_per_split)
    part = (torch.empty((split_k, m, n), dtype=torch.float32, device=x2.device)
            if split_k > 1 else out)
    has_bias = bias is not None
    pdl = pdl_options(x2.device)
    grid = (_cdiv(m, config["BLOCK_M"]) * _cdiv(n, config["BLOCK_N"]), split_k)
    _fp8_gemm_kernel[grid](
        x2, x2.stride(0), x_scale if x_scale is not None else weight.scale, q, weight.scale,
        bias if has_bias else out, out, part, m, n, k, k_per_split, HAS_BIAS=has_bias,
        SPLIT=split_k > 1, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        BLOCK_K=block_k, SWAP=config["SWAP"], EVEN_K=k % block_k == 0,
        X_FP8=x_scale is not None, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **pdl,
    )
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(_cdiv(m * n, block),)](
            part, bias if has_bias else out, out, m * n, n, SPLIT_K=split_k, HAS_BIAS=has_bias,
            BLOCK=block, **pdl,
        )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def weight_only_linear(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None, *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x @ W^T + bias in x's dtype, x [..., K] in bf16/fp16 as it is (``weight_ok``), W
    converted from e4m3 as it is loaded. ``config`` overrides the tiles (for tuning)."""
    n, k = weight.qweight.shape
    x2 = _rows(x)
    m = x2.shape[0]
    if config is None:
        config = default_config(m, n, k, _num_sms(x.device))
    return _gemm(x2, None, weight, bias, x.dtype, config).view(*x.shape[:-1], n)


@functools.cache
def _scaled_mm_device(device: torch.device) -> bool:
    # Row-wise scaled fp8 GEMMs: sm_89 (Ada) and later.
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def w8a8_ok(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
            k_factor: int = 1) -> bool:
    """Whether ``w8a8_linear`` takes this call: x and W as ``weight_ok`` takes them, on a
    device with fp8 tensor cores (or CPU tensors, through the interpreter), K and N
    multiples of 16 (``_scaled_mm``'s, past the Triton GEMM's rows)."""
    n, k = weight.qweight.shape
    device_ok = _scaled_mm_device(x.device) if x.is_cuda else x.device.type == "cpu"
    return (weight_ok(x, weight, bias, k_factor) and device_ok and n % 16 == 0
            and k % 16 == 0)


def m_bucket(m: int) -> int:
    """The W8A8 table's row bucket of m rows: the power of two at or above m, at least 16."""
    return max(16, 1 << max(0, m - 1).bit_length())


def w8a8_table_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig | None:
    """The Triton W8A8 GEMM's tiles for m rows of an [N, K] weight on ``device``, or None
    for ``torch._scaled_mm``: CUDA tensors take the device table's entry (none: _scaled_mm,
    measured or not), CPU tensors (no _scaled_mm) ``w8a8_config``."""
    if device.type != "cuda":
        return w8a8_config(m, n, k, _num_sms(device))
    if m > W8A8_GEMM_MAX_ROWS:
        return None
    entry = tuning.table_for(W8A8_OP, device).get((n, k), {}).get(m_bucket(m))
    return None if entry is None else GemmConfig(**entry)


def w8a8_matmul(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
    out_dtype: torch.dtype, *, config: GemmConfig | None = None,
) -> torch.Tensor:
    """(xq * x_scale[:, None]) @ W^T + bias in ``out_dtype``, rows already quantized (e4m3
    ``xq`` [M, K], fp32 ``x_scale`` [M]), as ``atom_core.quant.fp8.w8a8_matmul``: the Triton
    GEMM where ``w8a8_table_config`` (or ``config``, for tuning) gives tiles, else
    ``torch._scaled_mm``."""
    n, k = weight.qweight.shape
    if config is None:
        config = w8a8_table_config(xq.shape[0], n, k, xq.device)
    if config is not None:
        return _gemm(xq, x_scale, weight, bias, out_dtype, config)
    return torch._scaled_mm(xq, weight.qweight.t(), scale_a=x_scale[:, None],
                            scale_b=weight.scale[None, :], bias=bias, out_dtype=out_dtype,
                            use_fast_accum=SCALED_MM_FAST_ACCUM)


def w8a8_linear(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W^T + bias in x's dtype with x quantized per row (``w8a8_ok`` calls): the
    quantization kernel, then ``w8a8_matmul``."""
    n = weight.qweight.shape[0]
    xq, x_scale = quantize_rows(x)
    return w8a8_matmul(xq, x_scale, weight, bias, x.dtype).view(*x.shape[:-1], n)
