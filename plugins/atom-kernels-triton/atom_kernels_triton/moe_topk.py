"""MoE routing in one kernel: score -> (group limit) -> top-k -> renormalise -> scale.
``route`` (the ``moe_route`` op) puts the gate's GEMV in front of it.

``select_experts`` is ``atom_core.ops.native.moe.select_experts`` with one program per
token where the reference takes a dozen small kernels (softmax, topk, gather, sum, div,
mul, the group masking). The whole row of E scores lives in registers; top-k is k rounds
of argmax-and-mask. Ties go to the lowest expert index (torch.topk leaves them
unspecified), and a row's ids come out best first rather than in torch.topk's order:
fused_moe sums over a token's slots, so the order does not matter. Sizes come from the
shapes alone and nothing is read back on the host, so it captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.ops.deferred_norm import DeferredNorm
from atom_kernels_triton.gemv import linear_partials
from atom_kernels_triton.pdl import pdl_options, pdl_wait


@triton.jit
def _moe_topk_kernel(
    logits_ptr, logits_stride, split_stride, bias_ptr, weights_ptr, ids_ptr, num_experts,
    group_size, scale, ss_ptr, num_tokens, hidden, eps,
    SPLITS: tl.constexpr, ROW_SS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    # The logits come as SPLITS partial sums (the router GEMV's split-K), added here in the
    # order its reduce kernel would add them: the same logits, bit for bit, one launch fewer.
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=valid,
                other=float("-inf")).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        x += tl.load(logits_ptr + s * split_stride + row * logits_stride + offs, mask=valid,
                     other=0.0)
    if ROW_SS > 0:  # the router read a DeferredNorm's h * weight: its logits still want 1/rms(h)
        ss = 0.0
        for s in tl.static_range(ROW_SS):
            ss += tl.load(ss_ptr + s * num_tokens + row)
        x *= 1.0 / tl.sqrt(ss / hidden + eps)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))  # padding: exp(-inf) = 0
        scores = p / tl.sum(p, axis=0)
    choice = scores
    if HAS_BIAS:
        # The bias steers which experts are chosen, never their weights.
        choice += tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if NUM_GROUPS > 1:
        # Each expert carries its group's score; the TOPK_GROUP best groups stay open.
        group = offs // group_size
        group_score = tl.full([BLOCK_E], float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            member = tl.where(group == g, choice, float("-inf"))
            best = tl.max(member, axis=0)
            if HAS_BIAS:  # the sum of the group's best two (V3 noaux_tc)
                first = tl.argmax(member, axis=0, tie_break_left=True)
                best += tl.max(tl.where(offs == first, float("-inf"), member), axis=0)
            group_score = tl.where(group == g, best, group_score)
        # Padding experts (group >= NUM_GROUPS) keep -inf, so no round picks them.
        allowed = offs < 0  # none yet
        for _ in tl.static_range(TOPK_GROUP):
            picked = tl.argmax(group_score, axis=0, tie_break_left=True) // group_size
            allowed = allowed | (group == picked)
            group_score = tl.where(group == picked, float("-inf"), group_score)
        choice = tl.where(allowed, choice, float("-inf"))

    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0, tie_break_left=True)
        weights = tl.where(slots == j, tl.sum(tl.where(offs == best, scores, 0.0), axis=0), weights)
        ids = tl.where(slots == j, best.to(tl.int64), ids)
        choice = tl.where(offs == best, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, weights * scale, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    deferred: DeferredNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int64) from router logits [T, E]; the
    native op's contract, up to the order of each row's ids (best first here). Logits of
    shape [S, T, E] are S partial sums (``gemv.linear_partials``), added in order.
    ``deferred``: the logits are of that DeferredNorm's ``scaled`` rows, still to be scaled
    by 1/rms."""
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"MoE scoring function {scoring_func!r} is not supported")
    partials = router_logits if router_logits.dim() == 3 else router_logits[None]
    if partials.stride(-1) != 1 or partials.stride(0) != partials.stride(1) * partials.shape[1]:
        partials = partials.contiguous()
    splits, num_tokens, num_experts = partials.shape
    num_groups = num_expert_group if num_expert_group is not None and num_expert_group > 1 else 1
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=partials.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=partials.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    bias = e_score_correction_bias
    _moe_topk_kernel[(num_tokens,)](
        partials, partials.stride(1), partials.stride(0), bias if bias is not None else partials,
        weights, ids, num_experts, num_experts // num_groups, float(routed_scaling_factor),
        deferred.sumsq if deferred is not None else partials, num_tokens,
        deferred.summed.shape[-1] if deferred is not None else 1,
        deferred.eps if deferred is not None else 0.0,
        SPLITS=splits, ROW_SS=deferred.sumsq.shape[0] if deferred is not None else 0, TOP_K=top_k,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        SIGMOID=scoring_func == "sigmoid", HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
        NUM_GROUPS=num_groups, TOPK_GROUP=min(topk_group or 1, num_groups),
        # One warp holds a row of up to 256 experts in 8 registers a lane; its reductions
        # then stay in shuffles, which is what a decode step's latency wants.
        num_warps=max(1, min(8, block_e // 256)), **pdl_options(partials.device),
    )
    return weights, ids


def route(
    x: torch.Tensor | DeferredNorm,
    gate_weight: torch.Tensor,
    top_k: int,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moe_route`` op (``atom_core.ops.native.moe.route``): the gate's GEMV leaves its
    split-K partial sums to this module's kernel, which adds them as it loads the row; a
    ``DeferredNorm`` x's 1/rms is applied there too."""
    deferred = x if isinstance(x, DeferredNorm) else None
    return select_experts(
        linear_partials(x.scaled if deferred is not None else x, gate_weight), top_k, scoring_func,
        renormalize,
        num_expert_group, topk_group, e_score_correction_bias, routed_scaling_factor, deferred,
    )
