"""A mixture-of-experts layer's two ops: the router's choice and the routed experts.

``route(x [T, H], gate_weight [E, H], top_k, ...) -> (topk_weights [T, k], topk_ids
[T, k])`` (registered as ``moe_route``) is the gate: fp32 logits ``x @ gate_weight.T``,
then ``select_experts``, which scores, picks and weights each token's experts.

``fused_moe(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k],
topk_ids [T, k]) -> [T, H]``: each token's output is the sum over its k chosen experts e of
``topk_weights[t, j] * w2[e] @ (silu(gate) * up)`` with ``gate, up = split(w13[e] @ x)``
(gate rows first, the way HF stacks ``gate_proj`` above ``up_proj``). Ids outside
``[0, E)`` (an expert another rank owns, or a padding slot) contribute nothing. With
``num_shared_experts`` n, the last n of the E experts are shared: every token also takes
each of them with weight 1.0, after its k routed choices (which topk_ids holds alone).

The reference groups the T*k assignments by expert (one sort), then runs two GEMMs per
expert over just the rows routed to it, so its cost is that of the tokens' active
experts, never a dense E x T loop. It reads the per-expert counts on the host, which a
GPU kernel must not do; this is the CPU path and the kernels' yardstick.

``w13`` and ``w2`` may be ``Fp8Weight`` stacks (``atom_core.quant.fp8``): each expert's
product is then ``fp8_linear`` with that expert's weight. The step's token count T, not an
expert's share of it, picks the format: W8A8 (the rows, and the intermediate before ``w2``,
quantized per row) from T >= ``w8a8_min_rows`` on, weight-only below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.ops.deferred_norm import AddNorm, DeferredNorm
from atom_core.ops.native.linear import linear, rows_of
from atom_core.quant.fp8 import Fp8Weight, fp8_linear


def with_shared_expert_ids(
    topk_ids: torch.Tensor, num_experts: int, num_shared: int
) -> torch.Tensor:
    """The routed ids [T, k] with the shared experts' ids, E - n .. E - 1, appended to each
    row."""
    ids = torch.arange(num_experts - num_shared, num_experts, dtype=topk_ids.dtype,
                       device=topk_ids.device)
    return torch.cat((topk_ids, ids.expand(topk_ids.shape[0], -1)), dim=1)


def with_shared_experts(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, num_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed choices [T, k] with the shared experts' slots appended (weight 1.0 each)."""
    weights = torch.ones(num_shared, dtype=topk_weights.dtype, device=topk_weights.device)
    return (torch.cat((topk_weights, weights.expand(topk_weights.shape[0], -1)), dim=1),
            with_shared_expert_ids(topk_ids, num_experts, num_shared))


def expert_linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight, expert: int,
                  num_tokens: int) -> torch.Tensor:
    """x @ w[expert]^T: ``F.linear``, or ``fp8_linear`` in the format a step of
    ``num_tokens`` tokens picks."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w.expert(expert), w8a8=num_tokens >= w.w8a8_min_rows)
    return F.linear(x, w[expert])


def fused_moe(
    hidden: torch.Tensor | DeferredNorm,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_shared_experts: int = 0,
    add_norm: AddNorm | None = None,
) -> torch.Tensor:
    """The routed (and shared) experts' sum; ``add_norm`` declined and a ``DeferredNorm``
    normed, as ``linear`` does."""
    hidden = rows_of(hidden)
    if num_shared_experts:
        topk_weights, topk_ids = with_shared_experts(
            topk_weights, topk_ids, w13.shape[0], num_shared_experts
        )
    num_tokens, top_k = topk_ids.shape
    num_experts, inter2, _ = w13.shape
    inter = inter2 // 2
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)  # stable: rows keep token order per expert
    sorted_ids = flat_ids[order]
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    start = int((sorted_ids < 0).sum())  # negative ids sort first and are skipped
    counts = torch.bincount(sorted_ids[start:].clamp(max=num_experts), minlength=num_experts + 1)
    # Accumulate in fp32 so a bf16 model sums its k experts once, at the end.
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for expert, count in enumerate(counts[:num_experts].tolist()):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        tokens = token_of[rows]
        gate_up = expert_linear(hidden.index_select(0, tokens), w13, expert, num_tokens)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = expert_linear(act, w2, expert, num_tokens)
        out.index_add_(0, tokens, y.float() * weight_of[rows, None].float())
    return out.to(hidden.dtype)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int64) from router logits [T, E].

    Scores are softmax or sigmoid of the fp32 logits. ``e_score_correction_bias``
    (DeepSeek-V3's aux-loss-free balancing) shifts the scores used to *choose* experts,
    not the weights. With ``num_expert_group``, experts form that many equal groups and
    only the ``topk_group`` best groups may be chosen from; a group's score is its best
    expert's (DeepSeek-V2 ``group_limited_greedy``), or the sum of its best two when a
    correction bias is given (V3 ``noaux_tc``). Weights are then optionally renormalised
    to sum to one and multiplied by ``routed_scaling_factor``.
    """
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"MoE scoring function {scoring_func!r} is not supported")
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        if e_score_correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group or 1, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


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
    """The gate: ``select_experts`` over the logits ``x @ gate_weight.T`` (x promoted to
    the weight's fp32; see ``linear.promote``)."""
    return select_experts(
        linear(x, gate_weight), top_k, scoring_func, renormalize, num_expert_group, topk_group,
        e_score_correction_bias, routed_scaling_factor,
    )
