"""gpt-oss's routed experts (the ``clamped_swiglu_moe`` op) as two grouped GEMMs over
expert-sorted rows, with model-dtype or MXFP4 expert stacks.

Same contract as ``atom_core.ops.native.clamped_swiglu_moe``. The pieces are fused_moe's:
the (token, slot) pairs laid out by expert in blocks of BLOCK_M rows (``moe_align``), the
block sizes from a tuning table (``fused_moe_config.get_config``, this op's own table, the
heuristic where none exists) and the fixed-order per-token sum (``fused_moe``'s
``_sum_pairs_kernel``); then

1. ``_gate_up_kernel``: per block, gather the tokens' hidden rows, multiply by the block's
   expert's ``w13`` rows 2i (gate) and 2i + 1 (up), add ``w13_bias`` and write the clamped
   SwiGLU to an intermediate [rows, I];
2. ``_down_kernel``: multiply the intermediate by ``w2[e]``, add ``w2_bias``, scale by the
   routing weight and write each pair's contribution, fp32, to its own row of [T*k, H];
3. ``_sum_pairs_kernel``: sum each token's k rows in slot order, skipping the pairs whose
   id is outside ``[0, E)`` (they have no row), and cast.

A per-pair buffer summed in a fixed order rather than fp32 atomics into [T, H]: the output
is the same bits run to run (atomics add in whichever order programs finish), for T*k*H*4
bytes and one small launch.

The GEMM tiles are this module's, not fused_moe's: interleaved gate/up rows, biases, the
clamped activation and the MXFP4 decode would be four more modes in tiles that already
serve three launch forms and three weight formats. The launches are fused_moe's plain form
(one each); its persistent and overlapped forms are tuned per model and not measured here.

MXFP4 stacks (``atom_core.quant.mxfp4``) are weight-only at every step size: a tile loads
the packed bytes and their e8m0 scales, decodes the two e2m1 codes of each byte (the even
element in the low nibble) by bit arithmetic into fp32, scales them by 2**(scale - 127)
(exact: a power of two), rounds to the activations' dtype in registers and runs the same
``tl.dot``. The decoded tile is the dot's left operand (the kernels compute ``W @ x.T``
and transpose the accumulator): Hopper's wgmma takes its left operand from registers, where
the decode leaves it, and its right one from shared memory, where the pipeliner already
stages x's rows. With the weights on the right, Triton 3.6 (sm_90) has to stage the decoded
tile in shared memory, and it fails to compile 28 of the 32 tiles of 64 or 128 rows. The
blog's rule quantizes the activations from ``Mxfp4Weight.bf16_bound`` tokens on; that path
does not exist here, so past the bound the same weight-only kernels run (as the reference
does), and nothing is logged per step.

Every size is fixed by (T, k, E, H, I) and the config: no host sync, no data-dependent
shape, so a step using it can be captured in a CUDA graph. The kernels round where the
reference does (the linear outputs, each step of the activation, the expert output), so
both see the same values up to fp32 accumulation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.quant.mxfp4 import BLOCK as MXFP4_BLOCK
from atom_core.quant.mxfp4 import Mxfp4Weight
from atom_kernels_triton import tuning
from atom_kernels_triton.fused_moe import _sum_pairs_kernel
from atom_kernels_triton.fused_moe_config import MoeConfig, get_config
from atom_kernels_triton.moe_align import align_by_expert, aligned_capacity
from atom_kernels_triton.pdl import pdl_options, pdl_wait

OP = "clamped_swiglu_moe"
# The tiles bench/mxfp4_moe.py --sweep times and compile_check builds.
TILE_SPACE = {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (64, 128), "BLOCK_K": (64, 128),
              "num_warps": (4, 8), "num_stages": (3, 4)}


@triton.jit
def e2m1_to_f32(code):
    """The values of e2m1 codes (int32, 0..15: sign bit 3, exponent bits 2-1, mantissa bit
    0), assembled as fp32 bits: exponent e > 0 is 2**(e - 1) * (1 + m / 2), e = 0 is m / 2
    (0.5 as a normal fp32, so no denormal is formed)."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(scale):
    """2**(scale - 127) of e8m0 exponents (int32, 0..255) as fp32 bits; 0 is the one
    denormal, 2**-127."""
    return tl.where(scale == 0, 0x400000, scale << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile(blocks_ptr, scales_ptr, b_stride_n, s_stride_n, rows, row_ok, k0, K,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile ``W[rows, k0:k0+BLOCK_K]`` of an MXFP4 weight [N, K]
    (bytes [N, K/2] and scales [N, K/32], unit stride along K) in ``dtype``; zero where a
    row is not ``row_ok`` or past K. BLOCK_K is a multiple of 32: the tile holds whole
    scale groups, loaded as [rows, groups, 16 bytes] so each scale broadcasts over its own
    group without a reshape."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, GROUPS)
    g_ok = row_ok[:, None] & (g < K // 32)[None, :]
    s = tl.load(scales_ptr + rows[:, None] * s_stride_n + g[None, :], mask=g_ok, other=0)
    scale = e8m0_to_f32(s.to(tl.int32))[:, :, None]
    byte_off = g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    packed = tl.load(blocks_ptr + rows[:, None, None] * b_stride_n + byte_off,
                     mask=g_ok[:, :, None], other=0).to(tl.int32)
    lo = (e2m1_to_f32(packed & 15) * scale).to(dtype)
    hi = (e2m1_to_f32(packed >> 4) * scale).to(dtype)
    # Element 2j of a group is byte j's low nibble, 2j + 1 its high one.
    return tl.reshape(tl.interleave(lo, hi), (BLOCK_N, BLOCK_K))


@triton.jit
def _plain_tile(w_ptr, w_stride_n, w_stride_k, rows, row_ok, k0, K, BLOCK_K: tl.constexpr,
                dtype: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of one expert's model-dtype weight [N, K] (its ``rows``),
    transposed for ``tl.dot``."""
    kk = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + kk[:, None] * w_stride_k + rows[None, :] * w_stride_n,
                mask=(kk < K)[:, None] & row_ok[None, :], other=0.0)
    return w.to(dtype)


@triton.jit
def _rows_tile(ptr, row_offsets, valid, k0, K, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of the rows starting at ``row_offsets`` (elements), columns
    ``k0:k0+BLOCK_K``; zero for rows not ``valid`` and past K."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(ptr + row_offsets[:, None] + kk[None, :],
                   mask=valid[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _rounded(x, dt: tl.constexpr):
    """x rounded to the model dtype, back in fp32: where the reference's torch op ends."""
    return x.to(dt).to(tl.float32)


@triton.jit
def _gate_up_kernel(
    x_ptr, x_stride, w_ptr, w_stride_e, w_stride_n, w_stride_k, s_ptr, s_stride_e, s_stride_n,
    bias_ptr, bias_stride_e, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden,
    inter, alpha, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (block, n tile): [BLOCK_M, BLOCK_N] of the block's clamped SwiGLU."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:  # else past the last expert's segment
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < num_pairs
        x_rows = (pair // top_k).to(tl.int64) * x_stride
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        gate_rows, up_rows = 2 * cols, 2 * cols + 1  # w13's rows interleave gate and up
        w_base = w_ptr + expert * w_stride_e
        s_base = s_ptr + expert * s_stride_e
        dt = out_ptr.dtype.element_ty
        if MXFP4:  # weights on the left: module docstring
            gate_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                a_t = tl.trans(_rows_tile(x_ptr, x_rows, valid, k0, hidden, BLOCK_K))
                wg = mxfp4_tile(w_base, s_base, w_stride_n, s_stride_n, gate_rows, col_ok, k0,
                                hidden, BLOCK_N, BLOCK_K, dt)
                gate_t = tl.dot(wg, a_t, gate_t, input_precision=PRECISION)
                wu = mxfp4_tile(w_base, s_base, w_stride_n, s_stride_n, up_rows, col_ok, k0,
                                hidden, BLOCK_N, BLOCK_K, dt)
                up_t = tl.dot(wu, a_t, up_t, input_precision=PRECISION)
            gate, up = tl.trans(gate_t), tl.trans(up_t)
        else:
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                a = _rows_tile(x_ptr, x_rows, valid, k0, hidden, BLOCK_K)
                wg = _plain_tile(w_base, w_stride_n, w_stride_k, gate_rows, col_ok, k0, hidden,
                                 BLOCK_K, dt)
                wu = _plain_tile(w_base, w_stride_n, w_stride_k, up_rows, col_ok, k0, hidden,
                                 BLOCK_K, dt)
                gate = tl.dot(a, wg, gate, input_precision=PRECISION)
                up = tl.dot(a, wu, up, input_precision=PRECISION)
        if HAS_BIAS:
            b = bias_ptr + expert * bias_stride_e
            gate += tl.load(b + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # The reference's steps, each rounded as its torch op rounds:
        # (clamp(up, -l, l) + 1) * min(gate, l) * sigmoid(min(gate, l) * alpha).
        g = _rounded(tl.minimum(_rounded(gate, dt), limit), dt)
        u = _rounded(tl.clamp(_rounded(up, dt), -limit, limit), dt)
        glu = _rounded(_rounded(u + 1.0, dt) * g, dt)
        z = _rounded(g * alpha, dt)
        sig = _rounded(1.0 / (1.0 + tl.exp(-z)), dt)
        act = (glu * sig).to(dt)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], act,
                 mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, w_stride_e, w_stride_n, w_stride_k, s_ptr, s_stride_e, s_stride_n,
    bias_ptr, bias_stride_e, weights_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs,
    hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (block, n tile): [BLOCK_M, BLOCK_N] of the block's expert outputs plus bias,
    rounded to the model dtype (as F.linear's), weighted in fp32, into the pairs' rows."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        w_base = w_ptr + expert * w_stride_e
        s_base = s_ptr + expert * s_stride_e
        act_rows = rows.to(tl.int64) * inter
        dt = act_ptr.dtype.element_ty
        if MXFP4:  # weights on the left: module docstring
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                a = _rows_tile(act_ptr, act_rows, valid, k0, inter, BLOCK_K)
                w = mxfp4_tile(w_base, s_base, w_stride_n, s_stride_n, cols, col_ok, k0, inter,
                               BLOCK_N, BLOCK_K, dt)
                acc_t = tl.dot(w, tl.trans(a), acc_t, input_precision=PRECISION)
            acc = tl.trans(acc_t)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                a = _rows_tile(act_ptr, act_rows, valid, k0, inter, BLOCK_K)
                w = _plain_tile(w_base, w_stride_n, w_stride_k, cols, col_ok, k0, inter,
                                BLOCK_K, dt)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * bias_stride_e + cols, mask=col_ok,
                           other=0.0).to(tl.float32)[None, :]
        # topk_weights [T, k] contiguous: the flat pair index is its offset.
        scale = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        y = _rounded(acc, dt) * scale[:, None]
        tl.store(out_ptr + pair[:, None].to(tl.int64) * hidden + cols[None, :], y,
                 mask=valid[:, None] & col_ok[None, :])


def _operands(w: torch.Tensor | Mxfp4Weight) -> tuple[torch.Tensor | int, ...]:
    """The kernels' weight arguments: (weight or bytes, its strides e, n, k, scales, their
    strides e, n); a model-dtype stack has no scales (the weight stands in for the unread
    pointer)."""
    if isinstance(w, Mxfp4Weight):
        blocks = w.blocks if w.blocks.stride(-1) == 1 else w.blocks.contiguous()
        scales = w.scales if w.scales.stride(-1) == 1 else w.scales.contiguous()
        return (blocks, *blocks.stride(), scales, scales.stride(0), scales.stride(1))
    return (w, *w.stride(), w, 0, 0)


def _bias(bias: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    if bias is None:
        return fallback, 0
    bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    return bias, bias.stride(0)


def clamped_swiglu_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor | Mxfp4Weight,
    w13_bias: torch.Tensor | None,
    w2: torch.Tensor | Mxfp4Weight,
    w2_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    alpha: float,
    limit: float,
    *,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """[T, H]: each token's sum over its k experts e of ``topk_weights[t, j] * (w2[e] @
    act(w13[e] @ x + w13_bias[e]) + w2_bias[e])``, summed in fp32 (module docstring; the
    reference's docstring for ``act``). ``w13`` / ``w2``: model-dtype stacks or
    ``Mxfp4Weight`` ones, decoded weight-only whatever the step's size: from the stacks'
    ``bf16_bound`` on, the same weight-only kernels run (no activation is quantized, and
    nothing is logged per step). A bias may be None; ids outside ``[0, E)`` add nothing.
    ``config`` overrides the table's block sizes (for tuning)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter2, hidden_size = w13.shape
    inter = inter2 // 2
    num_pairs = num_tokens * top_k
    device = hidden.device
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    mxfp4_up, mxfp4_down = isinstance(w13, Mxfp4Weight), isinstance(w2, Mxfp4Weight)
    if config is None:
        config = get_config(num_tokens, top_k, num_experts, hidden_size, inter,
                            tuning.table_for(OP, device))
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if mxfp4_up or mxfp4_down:  # an MXFP4 tile holds whole scale groups
        block_k = max(block_k, MXFP4_BLOCK)
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
              "PRECISION": "ieee" if hidden.dtype == torch.float32 else "tf32",
              "num_warps": config["num_warps"], "num_stages": config["num_stages"],
              **pdl_options(device)}
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    sorted_pairs, block_expert = align_by_expert(ids, num_experts, block_m)
    blocks = aligned_capacity(num_pairs, num_experts, block_m) // block_m
    act = torch.empty((blocks * block_m, inter), dtype=hidden.dtype, device=device)
    # Pairs with an out-of-range id have no row and no program writes theirs: the sum skips them.
    per_pair = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=device)

    bias, bias_stride = _bias(w13_bias, x)
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, x.stride(0), *_operands(w13), bias, bias_stride, act, sorted_pairs, block_expert,
        num_pairs, top_k, hidden_size, inter, float(alpha), float(limit),
        MXFP4=mxfp4_up, HAS_BIAS=w13_bias is not None, **consts,
    )
    bias, bias_stride = _bias(w2_bias, x)
    _down_kernel[(blocks, triton.cdiv(hidden_size, block_n))](
        act, *_operands(w2), bias, bias_stride, weights, per_pair, sorted_pairs, block_expert,
        num_pairs, hidden_size, inter,
        MXFP4=mxfp4_down, HAS_BIAS=w2_bias is not None, **consts,
    )

    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=device)
    block_k_sum = triton.next_power_of_2(top_k)
    block_h = min(4096 // block_k_sum, triton.next_power_of_2(hidden_size))
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        per_pair, ids, out, top_k, top_k, num_experts, 0, hidden_size,
        out, out, out, out, num_tokens,
        BLOCK_K=block_k_sum, BLOCK_H=block_h, ADD_NORM=False, num_warps=4,
        **pdl_options(device),
    )
    return out
