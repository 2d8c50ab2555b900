"""Routed experts as two grouped GEMMs over expert-sorted rows (the ``fused_moe`` op).

Same contract as ``atom_core.ops.native.moe.fused_moe``, shared experts included. The
(token, slot) pairs are laid out by expert in blocks of BLOCK_M rows (``moe_align``); then

1. ``_gate_up_kernel``: per block, gather the tokens' hidden rows, multiply by the block's
   expert's ``w13`` and write ``silu(gate) * up`` to an intermediate [rows, I] (the
   activation is fused: gate and up tiles are accumulated side by side);
2. ``_down_kernel``: multiply the intermediate by ``w2[e]``, scale by the routing weight
   and write each pair's contribution to its own row of an fp32 [T*k, H] buffer;
3. ``_sum_pairs_kernel``: sum each token's k rows in slot order, skipping pairs whose id
   had no expert (their rows are never written: no memset of the buffer), and cast.

Where the config says ``PERSISTENT`` (the batch-1 buckets), 1 and 2 are one launch,
``_experts_kernel``: at one token the two launches' ramp and drain cost more than their
few tiles, while at 16+ tokens the separate launches overlap their tiles better. Where it
says ``OVERLAP`` (2-32 tokens), 2's programs wait on their own block's gate/up tiles, not
on the whole of 1, so the down tiles run while 1's last programs drain (``_down_kernel``).

``Fp8Weight`` stacks (fused_moe_fp8.py) run in the same kernels: weight-only, the tiles
convert the e4m3 weights as they load them and scale the accumulator per column; W8A8, the
hidden rows are quantized before 1 and the intermediate between 1 and 2 (two plain launches
then, whatever the config says), and the dots take e4m3 operands.

The per-pair buffer, not atomic adds into [T, H]: the k contributions are then summed in
a fixed order, so the output is bitwise reproducible run to run (atomics add in whatever
order the programs finish), and it is as graph-safe (fixed shape). It costs T*k*H*4 bytes
and one small reduction, little next to the weight traffic of the GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.ops.deferred_norm import AddNorm, DeferredNorm
from atom_core.quant.fp8 import Fp8Weight
from atom_kernels_triton import tuning
from atom_kernels_triton.deferred_norm import add_norm_store, row_rms_scale
from atom_kernels_triton.fused_moe_config import (
    OP,
    MoeConfig,
    for_w8a8,
    get_config,
)
from atom_kernels_triton.fused_moe_fp8 import (
    W8A8,
    WEIGHT_ONLY,
    fp8_mode,
    quantize_rows,
    weight_operands,
)
from atom_kernels_triton.gemv import reads_deferred
from atom_kernels_triton.moe_align import align_by_expert, aligned_capacity, pair_expert
from atom_kernels_triton.occupancy import resident_programs
from atom_kernels_triton.pdl import pdl_launch_next, pdl_options, pdl_wait


@triton.jit
def _gate_up_tile(
    x_ptr, x_stride, w_ptr, w_stride_e, w_stride_n, w_stride_k, out_ptr,
    pairs_ptr, expert, pid_m, pid_n, num_pairs, top_k, hidden, inter, ss_ptr, num_tokens, eps,
    ws_ptr, ws_stride_e, xs_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ROW_SS: tl.constexpr, W_FP8: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of block pid_m's ``silu(gate) * up``. ROW_SS > 0: x is a
    ``DeferredNorm``'s h * weight, and each token's gate and up rows are scaled by its 1/rms
    (from ss_ptr's ROW_SS partial sums) before they are rounded. W_FP8 (fused_moe_fp8's
    formats): e4m3 weights with scales ws_ptr [E, 2I], and in W8A8 e4m3 rows x with scales
    xs_ptr [T]."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * w_stride_e
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < hidden
        a = tl.load(x_ptr + token[:, None] * x_stride + kk[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_off = kk[:, None] * w_stride_k + cols[None, :] * w_stride_n
        wg = tl.load(w_base + w_off, mask=w_mask, other=0.0)
        wu = tl.load(w_base + inter * w_stride_n + w_off, mask=w_mask, other=0.0)
        if W_FP8 == 2:
            # Hopper's e4m3 MMAs add into the accumulator at reduced precision; summed into
            # fp32 once a K tile (as DeepSeek-V3 promotes every 128), the W8A8 output keeps
            # the reference's accuracy (H200, DeepSeek-V2-Lite's 1024-token tiles: 1.5e-2
            # rel. error to it without, 6.6e-3 with; 7% slower).
            gate = tl.dot(a, wg, gate, max_num_imprecise_acc=BLOCK_K)
            up = tl.dot(a, wu, up, max_num_imprecise_acc=BLOCK_K)
        else:
            if W_FP8 == 1:  # e4m3 values are exact in any model dtype
                wg = wg.to(a.dtype)
                wu = wu.to(a.dtype)
            gate = tl.dot(a, wg, gate, input_precision=PRECISION)
            up = tl.dot(a, wu, up, input_precision=PRECISION)
    if W_FP8 == 2:
        xs = tl.load(xs_ptr + token, mask=valid, other=0.0)[:, None]
        gate *= xs
        up *= xs
    if W_FP8 > 0:
        ws = ws_ptr + expert * ws_stride_e + cols
        gate *= tl.load(ws, mask=col_ok, other=0.0)[None, :]
        up *= tl.load(ws + inter, mask=col_ok, other=0.0)[None, :]
    if ROW_SS > 0:
        rs = row_rms_scale(ss_ptr, token, valid, num_tokens, hidden, eps, ROW_SS)[:, None]
        gate *= rs
        up *= rs
    # Round where the native op does (gate_up, silu, product in the model dtype), so
    # both paths see the same intermediate up to accumulation order.
    dt = out_ptr.dtype.element_ty
    g = gate.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    act = (s * up.to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], act,
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_tile(
    act_ptr, w_ptr, w_stride_e, w_stride_n, w_stride_k, weights_ptr, out_ptr,
    pairs_ptr, expert, pid_m, pid_n, num_pairs, top_k, routed_k, hidden, inter,
    ws_ptr, ws_stride_e, aq_ptr, as_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ACT_CACHE: tl.constexpr, W_FP8: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of block pid_m's expert outputs, weighted, into its pairs'
    rows. ACT_CACHE: the intermediate's load cache modifier (".cg" where this launch wrote it).
    W_FP8: e4m3 weights with scales ws_ptr [E, H], and in W8A8 the intermediate read as e4m3
    aq_ptr (act_ptr's layout) with row scales as_ptr."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * w_stride_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < inter
        a_off = rows[:, None].to(tl.int64) * inter + kk[None, :]
        a_mask = valid[:, None] & k_ok[None, :]
        if W_FP8 == 2:
            a = tl.load(aq_ptr + a_off, mask=a_mask, other=0.0, cache_modifier=ACT_CACHE)
        else:
            a = tl.load(act_ptr + a_off, mask=a_mask, other=0.0, cache_modifier=ACT_CACHE)
        w_off = kk[:, None] * w_stride_k + cols[None, :] * w_stride_n
        w = tl.load(w_base + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if W_FP8 == 2:  # into fp32 once a K tile, as in _gate_up_tile
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            if W_FP8 == 1:
                w = w.to(a.dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if W_FP8 == 2:
        acc *= tl.load(as_ptr + rows, mask=valid, other=0.0)[:, None]
    if W_FP8 > 0:
        acc *= tl.load(ws_ptr + expert * ws_stride_e + cols, mask=col_ok, other=0.0)[None, :]
    # Routed slots carry their routing weight ([T, routed_k]); shared experts' slots 1.0.
    t = pair // top_k
    j = pair - t * top_k
    scale = tl.load(weights_ptr + t * routed_k + j, mask=valid & (j < routed_k),
                    other=1.0).to(tl.float32)
    # The expert's output is rounded to the model dtype (as F.linear's is), then weighted in fp32.
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
    out_off = pair[:, None].to(tl.int64) * hidden + cols[None, :]
    tl.store(out_ptr + out_off, y, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _count_tile(ready_ptr, pid_m):
    """Count this program into its block's counter once its gate/up tile is stored (or at
    once, in a padding block): every thread's stores precede the release."""
    tl.debug_barrier()
    tl.atomic_add(ready_ptr + pid_m, 1, sem="release", scope="gpu")


@triton.jit
def _wait_block(ready_ptr, pid_m, up_tiles):
    """Spin until all ``up_tiles`` gate/up tiles of block pid_m are counted (acquire: their
    intermediate rows are then visible, read through L2)."""
    seen = tl.atomic_add(ready_ptr + pid_m, 0, sem="acquire", scope="gpu")
    while seen < up_tiles:
        seen = tl.atomic_add(ready_ptr + pid_m, 0, sem="acquire", scope="gpu")


@triton.jit
def _gate_up_kernel(
    x_ptr, x_stride, w_ptr, w_stride_e, w_stride_n, w_stride_k, out_ptr,
    pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter, ss_ptr, num_tokens, eps,
    ready_ptr, ws_ptr, ws_stride_e, xs_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ROW_SS: tl.constexpr, OVERLAP: tl.constexpr, PDL: tl.constexpr, W_FP8: tl.constexpr,
):
    """OVERLAP: the grid is (n tiles, blocks), so programs start block by block and blocks
    finish in order, and every program, a padding block's too, counts itself into its
    block's counter as its last access (``_down_kernel`` says why)."""
    pdl_wait(PDL)
    if OVERLAP:
        pid_m, pid_n = tl.program_id(1), tl.program_id(0)
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:  # else past the last expert's segment
        _gate_up_tile(
            x_ptr, x_stride, w_ptr, w_stride_e, w_stride_n, w_stride_k, out_ptr,
            pairs_ptr, expert, pid_m, pid_n, num_pairs, top_k, hidden, inter, ss_ptr, num_tokens,
            eps, ws_ptr, ws_stride_e, xs_ptr, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, ROW_SS, W_FP8,
        )
    if OVERLAP:
        _count_tile(ready_ptr, pid_m)


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, w_stride_e, w_stride_n, w_stride_k, weights_ptr, out_ptr,
    pairs_ptr, block_expert_ptr, num_pairs, top_k, routed_k, hidden, inter, ready_ptr, up_tiles,
    ws_ptr, ws_stride_e, aq_ptr, as_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    OVERLAP: tl.constexpr, PDL: tl.constexpr, W_FP8: tl.constexpr,
):
    """OVERLAP: no wait for the whole gate/up launch; each program waits for its own block's
    gate/up programs' counts (the grid is (n tiles, blocks), block by block as the gate/up
    kernel's), so down tiles run on the SMs the gate/up kernel's last programs leave idle.

    What orders it: PDL launches this kernel once every gate/up program has started. The
    launcher enables OVERLAP only where the gate/up grid cannot be resident all at once, so
    by then some gate/up program has passed its wait and finished: the alignment, and all
    before it, has completed, and the counters it zeroed are the ones read here. A count
    (acquire) then orders the block's layout and intermediate rows before their reads, from
    L2. Every gate/up program counts, and every program here waits for its block's full
    count, so this launch completes only after every gate/up program's last access: the
    kernel after it, waiting on this one, is ordered after both (pdl.py's rule)."""
    if OVERLAP:
        pdl_launch_next(PDL)
        pid_m, pid_n = tl.program_id(1), tl.program_id(0)
        _wait_block(ready_ptr, pid_m, up_tiles)
        expert = tl.load(block_expert_ptr + pid_m, cache_modifier=".cg").to(tl.int64)
        if expert >= 0:
            _down_tile(
                act_ptr, w_ptr, w_stride_e, w_stride_n, w_stride_k, weights_ptr, out_ptr,
                pairs_ptr, expert, pid_m, pid_n, num_pairs, top_k, routed_k, hidden, inter,
                ws_ptr, ws_stride_e, aq_ptr, as_ptr, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, ".cg",
                W_FP8,
            )
    else:
        pdl_wait(PDL)
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert >= 0:
            _down_tile(
                act_ptr, w_ptr, w_stride_e, w_stride_n, w_stride_k, weights_ptr, out_ptr,
                pairs_ptr, expert, pid_m, tl.program_id(1), num_pairs, top_k, routed_k, hidden,
                inter, ws_ptr, ws_stride_e, aq_ptr, as_ptr, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                "", W_FP8,
            )


@triton.jit
def _experts_kernel(
    x_ptr, x_stride, w13_ptr, w13_stride_e, w13_stride_n, w13_stride_k, act_ptr,
    w2_ptr, w2_stride_e, w2_stride_n, w2_stride_k, weights_ptr, out_ptr,
    pairs_ptr, block_expert_ptr, num_blocks, ready_ptr, num_pairs, top_k, routed_k, hidden, inter,
    ss_ptr, num_tokens, eps, w13s_ptr, w13s_stride_e, w2s_ptr, w2s_stride_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ROW_SS: tl.constexpr, BLOCKS_PAD: tl.constexpr, PDL: tl.constexpr, UP_FP8: tl.constexpr,
    DOWN_FP8: tl.constexpr,
):
    """Both GEMMs in one persistent launch. The work items are every real block's gate/up
    tiles, block by block, then its down tiles; program p takes items p, p + G, ... in order.
    A down tile needs all of its block's gate/up tiles: their programs count them into
    ``ready_ptr[block]`` (release), and the down tile's program waits for the full count
    (acquire). No program waits on an item after its own, every gate/up item precedes every
    down item, and all G programs are resident (the launcher sizes G from the occupancy),
    so the waits always end. The alignment zeroes the counts. UP_FP8 / DOWN_FP8: weight-only
    e4m3 stacks at most (the launcher keeps W8A8, whose inputs are quantized by launches of
    their own, out of this kernel)."""
    pdl_wait(PDL)
    b = tl.arange(0, BLOCKS_PAD)
    # Real blocks are a prefix of the layout (-1 past the last expert's segment).
    real = tl.sum((tl.load(block_expert_ptr + b, mask=b < num_blocks, other=-1) >= 0).to(tl.int32),
                  axis=0)
    up_tiles = tl.cdiv(inter, BLOCK_N)
    down_tiles = tl.cdiv(hidden, BLOCK_N)
    up_items = real * up_tiles
    for item in range(tl.program_id(0), up_items + real * down_tiles, tl.num_programs(0)):
        if item < up_items:
            pid_m = item // up_tiles
            expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
            _gate_up_tile(
                x_ptr, x_stride, w13_ptr, w13_stride_e, w13_stride_n, w13_stride_k, act_ptr,
                pairs_ptr, expert, pid_m, item - pid_m * up_tiles, num_pairs, top_k, hidden, inter,
                ss_ptr, num_tokens, eps, w13s_ptr, w13s_stride_e, w13s_ptr, BLOCK_M, BLOCK_N,
                BLOCK_K, PRECISION, ROW_SS, UP_FP8,
            )
            _count_tile(ready_ptr, pid_m)
        else:
            d = item - up_items
            pid_m = d // down_tiles
            expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
            _wait_block(ready_ptr, pid_m, up_tiles)
            _down_tile(
                act_ptr, w2_ptr, w2_stride_e, w2_stride_n, w2_stride_k, weights_ptr, out_ptr,
                pairs_ptr, expert, pid_m, d - pid_m * down_tiles, num_pairs, top_k, routed_k,
                hidden, inter, w2s_ptr, w2s_stride_e, act_ptr, w2s_ptr, BLOCK_M, BLOCK_N, BLOCK_K,
                PRECISION, ".cg", DOWN_FP8,
            )


@triton.jit
def _sum_pairs_kernel(
    per_pair_ptr, ids_ptr, out_ptr, top_k, routed_k, num_experts, num_shared, hidden,
    res_ptr, nw_ptr, scaled_ptr, ss_ptr, num_tokens,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, ADD_NORM: tl.constexpr, PDL: tl.constexpr,
):
    """ADD_NORM: out_ptr receives h = the sum + residual, scaled_ptr h * norm weight and ss_ptr
    this column block's sum of h * h (a ``DeferredNorm``)."""
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    # All k rows of the token in one [BLOCK_K, BLOCK_H] load (not k dependent loads in a
    # row), summed by one fixed-order reduction: the same sum every run.
    j = tl.arange(0, BLOCK_K)
    pair = token * top_k + j
    e = pair_expert(ids_ptr, pair, j < top_k, top_k, routed_k, num_experts - num_shared)
    # Else the pair had no row: its slot is garbage.
    used = (j < top_k) & (e >= 0) & (e < num_experts)
    rows = tl.load(per_pair_ptr + pair[:, None] * hidden + cols[None, :],
                   mask=used[:, None] & col_ok[None, :], other=0.0)
    y = tl.sum(rows, axis=0).to(out_ptr.dtype.element_ty)
    offs = token * hidden + cols
    if ADD_NORM:
        ss = add_norm_store(y, res_ptr + offs, nw_ptr + cols, out_ptr + offs, scaled_ptr + offs,
                            col_ok, 0)
        tl.store(ss_ptr + tl.program_id(1) * num_tokens + token, ss)
    else:
        tl.store(out_ptr + offs, y, mask=col_ok)


def fused_moe(
    hidden: torch.Tensor | DeferredNorm,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_shared_experts: int = 0,
    config: MoeConfig | None = None,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | DeferredNorm:
    """[T, H] MoE output; ``config`` overrides the table's block sizes (for tuning). The
    shared experts' slots (``num_shared_experts``) exist only as pair indices: no tensor
    of their ids or weights is built. ``hidden`` may be a ``DeferredNorm`` (its normed
    rows); with ``add_norm`` the pairs' sum finishes it and the output is a DeferredNorm
    (``atom_core.ops.deferred_norm``). ``w13`` / ``w2`` may be ``Fp8Weight`` stacks, each
    GEMM in the format T tokens pick (``fused_moe_fp8``)."""
    deferred = hidden if isinstance(hidden, DeferredNorm) else None
    if deferred is not None:
        hidden = deferred.scaled
    num_tokens, routed_k = topk_ids.shape
    top_k = routed_k + num_shared_experts
    num_experts, inter2, hidden_size = w13.shape
    inter = inter2 // 2
    num_pairs = num_tokens * top_k
    up_fp8, down_fp8 = fp8_mode(w13, num_tokens), fp8_mode(w2, num_tokens)
    w13, w13_scale, w13_scale_stride = weight_operands(w13)
    w2, w2_scale, w2_scale_stride = weight_operands(w2)
    w8a8 = W8A8 in (up_fp8, down_fp8)
    if config is None:
        fp8_format = W8A8 if w8a8 else WEIGHT_ONLY if WEIGHT_ONLY in (up_fp8, down_fp8) else 0
        config = get_config(num_tokens, top_k, num_experts, hidden_size, inter,
                            tuning.table_for(OP, hidden.device), fp8_format)
    elif w8a8:
        config = for_w8a8(config)
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"],
              **pdl_options(hidden.device)}
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    capacity = aligned_capacity(num_pairs, num_experts, block_m)
    # The occupancy bound the persistent launch relies on is NVIDIA's (32-thread warps). W8A8
    # takes the two plain launches: the intermediate's row scales need every gate/up tile of
    # a row, so a quantizing launch stands between the GEMMs, where the counted forms would
    # have the down tiles wait on gate/up tiles.
    persistent = config.get("PERSISTENT", 0) if torch.version.hip is None and not w8a8 else 0
    overlap = (config.get("OVERLAP", False) and not persistent and torch.version.hip is None
               and not w8a8)
    counted = persistent or overlap
    ready = (torch.empty(capacity // block_m, dtype=torch.int32, device=hidden.device)
             if counted else None)
    sorted_pairs, block_expert = align_by_expert(
        ids, num_experts, block_m, num_shared_experts, ready
    )
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    act = torch.empty((capacity, inter), dtype=hidden.dtype, device=hidden.device)
    # Pairs with an out-of-range id have no row and no program writes theirs: the sum skips them.
    per_pair = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    ss = deferred.sumsq if deferred is not None else act
    eps = deferred.eps if deferred is not None else 0.0
    row_ss = deferred.sumsq.shape[0] if deferred is not None else 0
    x_scale = act  # read in W8A8 only
    if up_fp8 == W8A8:
        # The rows as e4m3, a DeferredNorm's normed as they are quantized.
        x, x_scale = quantize_rows(x, sumsq=deferred.sumsq if deferred is not None else None,
                                   eps=eps)
        row_ss = 0
    if persistent:
        args = (
            x, x.stride(0), w13, w13.stride(0), w13.stride(1), w13.stride(2), act,
            w2, w2.stride(0), w2.stride(1), w2.stride(2), weights, per_pair,
            sorted_pairs, block_expert, capacity // block_m, ready, num_pairs, top_k, routed_k,
            hidden_size, inter, ss, num_tokens, eps, w13_scale, w13_scale_stride,
            w2_scale, w2_scale_stride,
        )
        consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "PRECISION": precision, "ROW_SS": row_ss,
                  "BLOCKS_PAD": triton.next_power_of_2(capacity // block_m),
                  "UP_FP8": up_fp8, "DOWN_FP8": down_fp8, **launch}
        tiles = triton.cdiv(inter, block_n) + triton.cdiv(hidden_size, block_n)
        items = (capacity // block_m) * tiles
        programs = min(items, resident_programs(_experts_kernel, args, consts, persistent))
        _experts_kernel[(programs,)](*args, **consts)
    else:
        blocks = capacity // block_m
        up_tiles, down_tiles = triton.cdiv(inter, block_n), triton.cdiv(hidden_size, block_n)
        # The counters; unused without OVERLAP.
        counts = ready if ready is not None else block_expert
        up_args = (
            x, x.stride(0), w13, w13.stride(0), w13.stride(1), w13.stride(2), act,
            sorted_pairs, block_expert, num_pairs, top_k, hidden_size, inter, ss, num_tokens, eps,
            counts, w13_scale, w13_scale_stride, x_scale,
        )
        consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "PRECISION": precision, **launch}
        # Overlap only where the gate/up grid cannot be resident all at once (the down kernel's
        # docstring says why that orders it after the alignment); twice the computed occupancy,
        # so that an occupancy figure on the low side cannot break the argument.
        overlap = overlap and blocks * up_tiles > 2 * resident_programs(
            _gate_up_kernel, up_args, {**consts, "ROW_SS": row_ss, "OVERLAP": True,
                                       "W_FP8": up_fp8},
            per_sm_cap=1 << 10)
        _gate_up_kernel[(up_tiles, blocks) if overlap else (blocks, up_tiles)](
            *up_args, ROW_SS=row_ss, OVERLAP=overlap, W_FP8=up_fp8, **consts,
        )
        act_q, act_scale = act, act  # read in W8A8 only
        if down_fp8 == W8A8:
            act_q, act_scale = quantize_rows(act, pairs=sorted_pairs, num_pairs=num_pairs)
        _down_kernel[(down_tiles, blocks) if overlap else (blocks, down_tiles)](
            act, w2, w2.stride(0), w2.stride(1), w2.stride(2), weights, per_pair,
            sorted_pairs, block_expert, num_pairs, top_k, routed_k, hidden_size, inter,
            counts, up_tiles, w2_scale, w2_scale_stride, act_q, act_scale, OVERLAP=overlap,
            W_FP8=down_fp8, **consts,
        )
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    block_k = triton.next_power_of_2(top_k)
    block_h = min(4096 // block_k, triton.next_power_of_2(hidden_size))
    col_blocks = triton.cdiv(hidden_size, block_h)
    finish = (add_norm is not None and add_norm.residual.shape == out.shape
              and add_norm.residual.dtype == out.dtype and reads_deferred(out, add_norm.reader))
    if finish:
        residual, scaled = add_norm.residual.contiguous(), torch.empty_like(out)
        sumsq = torch.empty((col_blocks, num_tokens), dtype=torch.float32, device=out.device)
    _sum_pairs_kernel[(num_tokens, col_blocks)](
        per_pair, ids, out, top_k, routed_k, num_experts, num_shared_experts, hidden_size,
        residual if finish else out, add_norm.weight if finish else out, scaled if finish else out,
        sumsq if finish else out, num_tokens,
        BLOCK_K=block_k, BLOCK_H=block_h, ADD_NORM=finish, num_warps=4,
        **pdl_options(hidden.device),
    )
    if finish:
        return DeferredNorm(out, scaled, sumsq, add_norm.weight, add_norm.eps)
    return out
