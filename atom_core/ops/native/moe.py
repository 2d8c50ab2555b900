"""Routed experts of a mixture-of-experts layer, given the router's choice.

``fused_moe(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k],
topk_ids [T, k]) -> [T, H]``: each token's output is the sum over its k chosen experts e of
``topk_weights[t, j] * w2[e] @ (silu(gate) * up)`` with ``gate, up = split(w13[e] @ x)``
(gate rows first, the way HF stacks ``gate_proj`` above ``up_proj``). Ids outside
``[0, E)`` (an expert another rank owns, or a padding slot) contribute nothing.

The reference groups the T*k assignments by expert (one sort), then runs two GEMMs per
expert over just the rows routed to it, so its cost is that of the tokens' active
experts, never a dense E x T loop. It reads the per-expert counts on the host, which a
GPU kernel must not do; this is the CPU path and the kernels' yardstick.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
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
        gate_up = F.linear(hidden.index_select(0, tokens), w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[expert])
        out.index_add_(0, tokens, y.float() * weight_of[rows, None].float())
    return out.to(hidden.dtype)
