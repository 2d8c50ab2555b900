"""Skinny GEMM (the ``linear`` op) for decode-sized batches: stream each weight row once.

Same contract as ``F.linear(x, weight, bias)``. At decode, M (the rows of x) is a handful
and the op is bound by reading W, yet cuBLAS picks GEMM tilings that reach a fraction of
HBM bandwidth on the small projection matrices. Here each program owns BLOCK_N output
features (rows of W) for all M rows of x and reads its rows of W once, BLOCK_K at a time
(fp32 accumulation, 16-byte loads along K); x is a few KB and stays in cache.

- M == 1: multiply-and-add into a [BLOCK_N, BLOCK_K] fp32 tile, one reduction at the end
  (no tensor cores: a 1-row product is a dot per output, and BLOCK_N can go below the
  16 that ``tl.dot`` needs, which gives small-N matrices more programs).
- 2 <= M <= MAX_ROWS, 16-bit W: ``tl.dot`` on x padded to 16 rows. 16 is ``tl.dot``'s
  smallest tile, so every row shares one pass over W.
- 2 <= M, fp32 W (the MoE router's gate, x promoted as it loads): fp32 FMAs into a
  [rows, BLOCK_N, BLOCK_K] tile, as the 1-row path: on an H200 it ran Qwen3-30B-A3B's
  128 x 2048 router faster at 8-32 rows than ``tl.dot`` in ieee precision or cuBLAS.
- 17..WIDE_ROWS rows of a 16-bit W: one 32-row ``tl.dot`` tile with the operands swapped
  (W x^T: W's tile is the product's M side), only for the shapes whose table has a 32-row
  entry (``gemv_config.WIDE_ROWS``, split along K), else ``F.linear``: a 32-row tile for
  every shape slowed batch-32 decode on the H200, so cuBLAS keeps the shapes where it is
  faster.
- Larger M falls back to ``F.linear``, except for a small W (``ROW_BLOCKS_MAX_WEIGHT_BYTES``:
  the MoE routers), whose rows go in blocks of up to 16 on a third grid axis, each block
  reading W again from L2.
- SPLIT_K > 1 (few output features, long K: o_proj, down_proj) splits K across programs
  so the grid fills the GPU. The partial sums go to an fp32 [SPLIT_K, M, N] buffer that a
  second kernel sums in a fixed order, casts and biases: bitwise reproducible, unlike
  atomics, and graph-capturable (shapes decide everything, buffers are ``torch.empty``).

``silu_and_mul_linear`` is the gated MLP's down projection with the activation fused in
(GATED): x is the gate_up output [1, 2K], and each x tile is formed as silu(gate) * up while
it is loaded, rounded exactly as ``silu_and_mul`` (activation.py) rounds it, so the result is
bitwise the unfused ``linear(silu_and_mul(x), w)`` and a decode step has one kernel fewer a
layer. ``rms_norm_linear`` (NORM) is a pre-norm block's norm and first projection, by
linearity: W (h * g / rms(h)) = (W (h * g)) / rms(h), so each program multiplies W by h * g
(h = x + residual, g the norm weight) and sums h * h over the same tiles, and the 1/rms
factor scales the result at the end (in the split-K reduce, from the splits' partial sums
of squares). The rounding moves: the unfused norm rounds h * g / rms(h) to the model
dtype; here h * g stays in fp32, so the result differs from the two ops by about one
rounding of x. The first column of programs writes h, the residual stream's next value. A
kernel fewer, twice a layer, and no pass over h before the product starts.

Both fused forms serve one row (batch-1 decode); more rows call the two ops. On the
``tl.dot`` path the x tile needs work between its load and the dot, and Triton then does
not pipeline the loop, which made the fused forms several times slower than the two ops
at 16 and 32 rows on an H200.

Block sizes, and whether to call cuBLAS instead, come from ``gemv_config.get_config``.

An ``Fp8Weight`` (e4m3 values, fp32 scale per output feature) below its ``w8a8_min_rows``
runs the same kernel with W loaded as e4m3, half the bytes of a 16-bit W, and converted as
it is loaded (to fp32 on the 1-row path, to x's dtype for ``tl.dot``); the accumulator is
multiplied by the scales before it is stored or written as split-K partials, so the
reduce, bias and norms are unchanged, the fused forms included. The product comes in x's
dtype. cuBLAS cannot take the weight, so the table never sends it there
(``gemv_config.fp8_config``); rows past MAX_ROWS go to fp8_gemm.py: its weight-only GEMM
below ``w8a8_min_rows``, the W8A8 GEMM from there on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.ops.deferred_norm import AddNorm, DeferredNorm, normed
from atom_core.ops.native.linear import linear as native_linear
from atom_core.quant.fp8 import Fp8Weight, uses_w8a8
from atom_kernels_triton import fp8_gemm, fp8_norm_quant, tuning
from atom_kernels_triton.activation import silu_and_mul, silu_and_mul_tile
from atom_kernels_triton.deferred_norm import add_norm_store, row_rms_scale
from atom_kernels_triton.fp8_quant import quantize_rows
from atom_kernels_triton.gemv_config import (
    H200_SMS,
    MAX_ROWS,
    OP,
    ROW_BLOCKS_MAX_ROWS,
    ROW_BLOCKS_MAX_WEIGHT_BYTES,
    WIDE_ROWS,
    GemvConfig,
    get_config,
    wide_config,
)
from atom_kernels_triton.norm import fused_add_rms_norm, rms_norm
from atom_kernels_triton.occupancy import device_limits
from atom_kernels_triton.pdl import pdl_options, pdl_wait

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _load_x(ptrs, mask, K, GATED: tl.constexpr):
    """The x tile at ``ptrs``; GATED: silu(gate) * up, gate at ``ptrs`` and up K further on,
    as ``silu_and_mul`` rounds it. Masked-out entries are 0 either way."""
    if GATED:
        return silu_and_mul_tile(ptrs, mask, K)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_norm_x(ptrs, res_ptrs, nw_ptrs, sum_ptrs, mask, store_mask, HAS_RES: tl.constexpr):
    """(h * norm weight in fp32, h * h) for the tile of h = x (+ residual), the sum rounded to
    the model dtype as ``fused_add_rms_norm`` rounds it and stored (``store_mask``) as the
    residual stream's next value. The 1/rms factor is applied to the product at the end."""
    h = tl.load(ptrs, mask=mask, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(sum_ptrs, h, mask=store_mask)
    hf = h.to(tl.float32)
    return hf * tl.load(nw_ptrs, mask=mask, other=0.0).to(tl.float32), hf * hf


@triton.jit
def _as_operand(w, a, W_SCALE: tl.constexpr):
    """A W tile as a ``tl.dot`` operand beside x's tile ``a``: e4m3 converted to x's dtype
    (exact in bf16 and fp16), a 16-bit tile as it is."""
    if W_SCALE:
        return w.to(a.dtype)
    else:
        return w


@triton.jit
def _gemv_kernel(
    x_ptr, x_stride, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
    res_ptr, nw_ptr, sum_ptr, ss_ptr, eps, row_ss_ptr, w_scale_ptr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, FMA: tl.constexpr,
    SWAP: tl.constexpr, ROW_SS: tl.constexpr, W_SCALE: tl.constexpr,
):
    """ROW_SS > 0: x is a ``DeferredNorm``'s h * weight and row_ss_ptr its [ROW_SS, M] partial
    sums of h * h; each row of the product is scaled by 1/rms(h) at the end (here, or in the
    split-K reduce). W_SCALE: W is e4m3 (an ``Fp8Weight``), converted as it is loaded, and
    the product's columns are multiplied by w_scale_ptr's fp32 scales before anything else
    (the store, the split-K partials): the reduce, bias and norms see a plain product."""
    pid_k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # Out-of-range features re-read the last row instead of masking: W loads stay unmasked
    # along N (vectorized), and their results are never stored.
    w_off = tl.minimum(cols, N - 1).to(tl.int64) * K
    w_rows = w_ptr + w_off[:, None]
    w_cols = w_ptr + w_off[None, :]
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # past MAX_ROWS: a block of rows
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # NORM: the first column of programs writes the summed residual, each split its K range.
    owner = (tl.zeros([BLOCK_M], tl.int32) + tl.program_id(0)) == 0
    # The first K tile is peeled: its W is loaded before waiting on the previous kernel
    # (pdl.py), since no kernel of a step writes weights; x only after the wait.
    kk = k_start + ks
    k_ok = kk < k_end
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride
    if BLOCK_M == 1:
        w0 = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
        pdl_wait(PDL)
        if NORM:
            a, sq = _load_norm_x(x_ptr + kk, res_ptr + kk, nw_ptr + kk, sum_ptr + kk, k_ok,
                                 k_ok & owner, HAS_RES)
        else:
            a = _load_x(x_ptr + kk, k_ok, K, GATED).to(tl.float32)
        acc2 = w0.to(tl.float32) * a[None, :]
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            if NORM:
                a, sq_k = _load_norm_x(x_ptr + kk, res_ptr + kk, nw_ptr + kk, sum_ptr + kk, k_ok,
                                       k_ok & owner, HAS_RES)
                sq += sq_k
            else:
                a = _load_x(x_ptr + kk, k_ok, K, GATED).to(tl.float32)
            w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            acc2 += w * a[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]
        if NORM:
            ss = tl.zeros([BLOCK_M], tl.float32) + tl.sum(sq, axis=0)
    elif FMA:
        # An fp32 weight (the MoE router's) on several rows: products in fp32 FMAs, a
        # [BLOCK_M, BLOCK_N, BLOCK_K] tile summed over K at the end, as the 1-row path does.
        # tl.dot in ieee precision ran the router slower (module docstring).
        tl.static_assert(not (NORM or GATED), "the fused forms run on the 1-row path only")
        w0 = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
        pdl_wait(PDL)
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc3 = a[:, None, :] * w0.to(tl.float32)[None, :, :]
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            acc3 += a[:, None, :] * w[None, :, :]
        acc = tl.sum(acc3, axis=2)
    elif SWAP:
        # The 32-row tile (SWAP), operands swapped: W's [BLOCK_N, BLOCK_K] tile is the product's
        # M side and x's rows its N side (W x^T, transposed at the end), the way small-M
        # GEMMs are usually laid out for tensor cores; on an H200 it beat x W^T, each with
        # its sweep's best tiles, on the 32-row projections.
        tl.static_assert(not (NORM or GATED), "the fused forms run on the 1-row path only")
        w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
        pdl_wait(PDL)
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc_t = tl.dot(_as_operand(w, a, W_SCALE), tl.trans(a))
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            acc_t = tl.dot(_as_operand(w, a, W_SCALE), tl.trans(a), acc_t)
        acc = tl.trans(acc_t)
    else:
        # 16-bit or e4m3 weights (fp32 ones take the FMA path). The fused forms serve one row
        # (module docstring): no x transform on this path.
        tl.static_assert(not (NORM or GATED), "the fused forms run on the 1-row path only")
        # The W^T tile [BLOCK_K, BLOCK_N], addressed directly: contiguous along K, so the
        # loads still vectorize.
        w_t = tl.load(w_cols + kk[:, None], mask=k_ok[:, None], other=0.0)
        pdl_wait(PDL)
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, _as_operand(w_t, a, W_SCALE),
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_t = tl.load(w_cols + kk[:, None], mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, _as_operand(w_t, a, W_SCALE), acc)
    if W_SCALE:
        acc *= tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        offs = (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part_ptr + offs, acc, mask=mask)
        if NORM:  # this split's share of each row's sum of squares
            tl.store(ss_ptr + pid_k * M + rows, ss, mask=row_ok & owner)
    else:
        if NORM:
            acc *= (1.0 / tl.sqrt(ss / K + eps))[:, None]
        if ROW_SS > 0:
            acc *= row_rms_scale(row_ss_ptr, rows, row_ok, M, K, eps, ROW_SS)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, b_ptr, out_ptr, ss_ptr, M, N, K, eps,
    res_ptr, nw_ptr, scaled_ptr, ss_out_ptr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SS_PARTS: tl.constexpr, ADD_NORM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Sums the splits in order; SS_PARTS > 0 scales the row by 1/rms from that many partial
    sums of squares at ss_ptr (the fused norm's, or a ``DeferredNorm``'s). ADD_NORM: out_ptr
    receives h = y + residual (not y), scaled_ptr h * norm weight, and ss_out_ptr this
    column block's sum of h * h: a ``DeferredNorm`` for the next op."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < N
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same sum every run
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + cols, mask=col_ok, other=0.0)
    if SS_PARTS > 0:
        ss = 0.0
        for s in tl.static_range(SS_PARTS):
            ss += tl.load(ss_ptr + s * M + row)
        acc *= 1.0 / tl.sqrt(ss / K + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    offs = row.to(tl.int64) * N + cols
    y = acc.to(out_ptr.dtype.element_ty)
    if ADD_NORM:
        ss = add_norm_store(y, res_ptr + offs, nw_ptr + cols, out_ptr + offs, scaled_ptr + offs,
                            col_ok, 0)
        tl.store(ss_out_ptr + tl.program_id(1) * M + row, ss)
    else:
        tl.store(out_ptr + offs, y, mask=col_ok)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return device_limits(device).sms


def supported(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None, *,
    gated: bool = False, fused: bool = False,
) -> bool:
    """Whether the kernel serves this call (else ``linear`` falls back to ``F.linear``);
    ``gated``: x holds gate | up, twice weight's K wide (``silu_and_mul_linear``); ``fused``
    (``gated`` or a norm in the loads): one row only. Past MAX_ROWS rows, a weight with a
    32-row table entry (up to gemv_config.WIDE_ROWS rows) or a small weight
    (gemv_config.ROW_BLOCKS_MAX_WEIGHT_BYTES). An ``Fp8Weight``: up to MAX_ROWS rows below
    its ``w8a8_min_rows`` (more go to fp8_gemm.py)."""
    if x.dim() == 0 or x.shape[-1] == 0:
        return False
    rows = x.numel() // x.shape[-1]
    if isinstance(weight, Fp8Weight):
        return (
            0 < rows <= (1 if fused or gated else MAX_ROWS)
            and not uses_w8a8(x, weight)
            and fp8_gemm.weight_ok(x, weight, bias, k_factor=2 if gated else 1)
        )
    if fused or gated:
        rows_ok = rows == 1
    elif rows > MAX_ROWS:
        small = weight.numel() * weight.element_size() <= ROW_BLOCKS_MAX_WEIGHT_BYTES
        wide = weight.dim() == 2 and wide_config(
            rows, *weight.shape, weight.element_size(), tuning.table_for(OP, weight.device)
        ) is not None
        rows_ok = wide or (rows <= ROW_BLOCKS_MAX_ROWS and small)
    else:
        rows_ok = rows > 0
    return (
        rows_ok
        and weight.dim() == 2
        and weight.shape[1] * (2 if gated else 1) == x.shape[-1]
        and weight.is_contiguous()
        and weight.dtype in DTYPES
        # An fp32 weight (the MoE router's) takes a half-precision x, promoted as it loads.
        and (x.dtype == weight.dtype
             or (weight.dtype == torch.float32 and x.dtype in DTYPES and not gated))
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _elem_size(weight: torch.Tensor | Fp8Weight) -> int:
    return 1 if isinstance(weight, Fp8Weight) else weight.element_size()


def reads_deferred(x: torch.Tensor, reader: torch.Tensor | Fp8Weight | None) -> bool:
    """Whether ``linear`` with weight ``reader`` (None: a reader that always can) would read
    a DeferredNorm of rows like x through the kernel, rather than norm them for cuBLAS (or
    for fp8_gemm.py's products)."""
    if reader is None:
        return True
    if not supported(x, reader, None):
        return False
    m, (n, k) = x.numel() // x.shape[-1], reader.shape
    table = tuning.table_for(OP, reader.device)
    return get_config(m, n, k, _elem_size(reader), _num_sms(reader.device), table) is not None


def _launch(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None,
    config: GemvConfig | None,
    gated: bool,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None, reduce: bool = True,
    deferred: DeferredNorm | None = None, add_norm: AddNorm | None = None,
) -> tuple[torch.Tensor | DeferredNorm, torch.Tensor | None] | None:
    """(the product, the summed residual rows where ``norm`` has a residual) for a
    ``supported`` call, or None where the table says cuBLAS. ``norm``: (residual or None,
    norm weight, eps) of an RMSNorm applied to x (+ residual) as it is loaded. ``deferred``:
    x is that DeferredNorm's ``scaled``, and the product's rows are scaled by 1/rms.
    ``add_norm``: where the product goes through the split-K reduce (and has more than one
    row), the reduce finishes it and the product comes as a ``DeferredNorm``. Without
    ``reduce`` the product comes as [S, M, N] split-K partial sums, S = 1 when unsplit, for
    the next kernel to add in order (``linear_partials``); no bias or norm then. An
    ``Fp8Weight``'s product comes in x's dtype."""
    fp8 = isinstance(weight, Fp8Weight)
    w_scale = weight.scale if fp8 else None
    weight = weight.qweight if fp8 else weight
    n, k = weight.shape
    x2 = _rows(x)
    m = x2.shape[0]
    if config is None:
        config = get_config(
            m, n, k, weight.element_size(), _num_sms(weight.device),
            tuning.table_for(OP, weight.device),
        )
        if config is None:  # measured: cuBLAS is at least as fast for this shape
            return None
    block_n, block_k, split_k = config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    # Each split covers whole BLOCK_K chunks, so no chunk straddles two splits.
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # drops splits that would start past K
    out = torch.empty((m, n), dtype=x.dtype if fp8 else weight.dtype, device=x.device)
    part = (torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
            if split_k > 1 else out)
    has_bias = bias is not None
    residual, norm_weight, eps = norm if norm is not None else (None, weight, 0.0)
    if deferred is not None:
        eps = deferred.eps
    res2 = _rows(residual) if residual is not None else x2
    # A new tensor: programs of the other columns still read the residual.
    summed = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    ss = (torch.empty((split_k, m), dtype=torch.float32, device=x.device)
          if norm is not None and split_k > 1 else out)
    row_ss = deferred.sumsq if deferred is not None else out
    row_parts = deferred.sumsq.shape[0] if deferred is not None else 0
    pdl = pdl_options(x.device)
    fma = m > 1 and weight.dtype == torch.float32
    # tl.dot's smallest tile is 16 rows; the FMA path's tile grows with the rows it holds.
    if m == 1:
        block_m = 1
    elif fma:
        block_m = min(MAX_ROWS, triton.next_power_of_2(m))
    else:
        wide = wide_config(m, n, k, weight.element_size(), tuning.table_for(OP, weight.device))
        block_m = MAX_ROWS if wide is None else WIDE_ROWS
    _gemv_kernel[(triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))](
        x2, x2.stride(0), weight, bias if has_bias else weight, out, part, m, n, k, k_per_split,
        res2, norm_weight, summed if summed is not None else x2, ss, eps, row_ss,
        w_scale if fp8 else out, HAS_BIAS=has_bias, SPLIT=split_k > 1, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        GATED=gated, NORM=norm is not None, HAS_RES=residual is not None, FMA=fma,
        SWAP=block_m == WIDE_ROWS, ROW_SS=row_parts if split_k == 1 else 0, W_SCALE=fp8,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl,
    )
    if not reduce:
        return part if split_k > 1 else out[None], None
    if split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        col_blocks = triton.cdiv(n, block)
        finish = (add_norm is not None and m > 1 and add_norm.residual.shape == (*x.shape[:-1], n)
                  and add_norm.residual.dtype == out.dtype and reads_deferred(out, add_norm.reader))
        if finish:
            res_out, scaled = add_norm.residual.reshape(m, n).contiguous(), torch.empty_like(out)
            ss_out = torch.empty((col_blocks, m), dtype=torch.float32, device=x.device)
        _split_k_reduce_kernel[(m, col_blocks)](
            part, bias if has_bias else weight, out, ss if norm is not None else row_ss, m, n, k,
            eps, res_out if finish else out, add_norm.weight if finish else out,
            scaled if finish else out, ss_out if finish else out,
            SPLIT_K=split_k, HAS_BIAS=has_bias, SS_PARTS=split_k if norm is not None else row_parts,
            ADD_NORM=finish, BLOCK=block, **pdl,
        )
        if finish:
            shape = (*x.shape[:-1], n)
            result = DeferredNorm(
                out.view(shape), scaled.view(shape), ss_out, add_norm.weight, add_norm.eps
            )
            return result, None
    return out.view(*x.shape[:-1], n), summed.view(x.shape) if summed is not None else None


def _fallback(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """The product where the GEMV does not serve it: cuBLAS for a plain weight; for an
    ``Fp8Weight`` (which cuBLAS cannot take as it is) the W8A8 GEMM from its
    ``w8a8_min_rows`` on, else the weight-only GEMM (fp8_gemm.py), and the reference
    only where neither takes the call (an fp32 x, CPU tensors at W8A8 sizes)."""
    if isinstance(weight, Fp8Weight):
        if uses_w8a8(x, weight):
            if fp8_gemm.w8a8_ok(x, weight, bias):
                return fp8_gemm.w8a8_linear(x, weight, bias)
        elif fp8_gemm.weight_ok(x, weight, bias):
            return fp8_gemm.weight_only_linear(x, weight, bias)
    return native_linear(x, weight, bias)


def linear(
    x: torch.Tensor | DeferredNorm, weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None, *,
    config: GemvConfig | None = None, add_norm: AddNorm | None = None,
) -> torch.Tensor | DeferredNorm:
    """x @ weight.T + bias, an fp32 weight promoting x (the native op's contract), an
    ``Fp8Weight``'s product in x's dtype; ``config`` overrides the table's block sizes (for
    tuning). x may be a ``DeferredNorm`` (its normed rows); with ``add_norm`` the result
    may come as one (deferred_norm.py)."""
    if isinstance(x, DeferredNorm):
        res = _launch(x.scaled, weight, bias, config, gated=False, deferred=x, add_norm=add_norm) \
            if supported(x.scaled, weight, bias) else None
        if res is not None:
            return res[0]
        x = normed(x, rms_norm)
    ok = supported(x, weight, bias)
    res = _launch(x, weight, bias, config, gated=False, add_norm=add_norm) if ok else None
    return _fallback(x, weight, bias) if res is None else res[0]


def linear_partials(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x [M, K] @ weight.T as [S, M, N] partial sums whose sum over S, taken in order, is
    what ``linear`` returns bit for bit (S = 1 where the product is not split along K): the
    split-K reduce left to the kernel that reads the product, one launch fewer. The MoE
    router's logits go this way into the top-k kernel (``moe_topk.route``)."""
    ok = supported(x, weight, None)
    res = _launch(x, weight, None, None, gated=False, reduce=False) if ok else None
    return _fallback(x, weight, None)[None] if res is None else res[0]


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None, *,
    config: GemvConfig | None = None, add_norm: AddNorm | None = None,
) -> torch.Tensor | DeferredNorm:
    """``linear(silu_and_mul(x), weight, bias)``, x [..., 2K] (gate | up) and weight [N, K]:
    one kernel for one row where the table has a config (the same bits as the two); an
    ``Fp8Weight`` at W8A8 rows: the activation formed and quantized per row by one kernel
    (``fp8_quant.quantize_rows(gated=True)``, the same bits), then the W8A8 product; else
    the two ops (``add_norm`` as ``linear``'s)."""
    if (isinstance(weight, Fp8Weight) and uses_w8a8(x, weight)
            and fp8_gemm.w8a8_ok(x, weight, bias, k_factor=2)):
        xq, x_scale = quantize_rows(x, gated=True)
        out = fp8_gemm.w8a8_matmul(xq, x_scale, weight, bias, x.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])
    ok = supported(x, weight, bias, gated=True)
    res = _launch(x, weight, bias, config, gated=True) if ok else None
    if res is not None:
        return res[0]
    return linear(silu_and_mul(x), weight, bias, config=config, add_norm=add_norm)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(h), weight, bias), h) for h = x + residual (x where residual is
    None): a pre-norm block's norm and first projection. One kernel for one row where the
    table has a config (the 1/rms factor applied to the product; see the module docstring),
    else the norm op and ``linear``; an ``Fp8Weight`` at W8A8 rows takes the rows normed and
    quantized by one kernel (fp8_norm_quant.py)."""
    if fp8_norm_quant.takes_linear(x, residual, norm_weight, weight):
        return fp8_norm_quant.rms_norm_w8a8_linear(x, residual, norm_weight, eps, weight, bias)
    ok = (
        supported(x, weight, bias, fused=True)
        and (isinstance(weight, Fp8Weight) or x.dtype == weight.dtype)
        and norm_weight.shape == (x.shape[-1],)
        and norm_weight.is_contiguous()
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
    )
    res = _launch(x, weight, bias, config, gated=False,
                  norm=(residual, norm_weight, eps)) if ok else None
    if res is not None:
        out, summed = res
        return out, summed if summed is not None else x
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias, config=config), x
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias, config=config), summed
