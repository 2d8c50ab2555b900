"""DeepSeek's feed-forward blocks: the dense SwiGLU MLP (the first layers) and the MoE block
(router + routed experts + shared experts).

The shared experts (one SwiGLU MLP of intermediate size ``n_shared_experts *
moe_intermediate_size``) are folded into the routed ``FusedMoE`` as n always-selected
experts of weight 1.0 (DeepSeek adds the shared output unscaled; ``routed_scaling_factor``
is already in the routed weights), so one ``fused_moe`` call does both. The checkpoint's
``shared_experts.*`` tensors load into those slots (``load_hf_moe_weights``).

Routing, by architecture (both as transformers and DeepSeek's reference code route):
- V2: softmax scores; ``topk_method`` "greedy" (plain top-k) or "group_limited_greedy"
  (top-k within the ``topk_group`` best of ``n_group`` groups, a group scored by its best
  expert); weights times ``routed_scaling_factor``. ``norm_topk_prob`` renormalises instead
  of scaling, as the reference code does (transformers ignores it; every released V2
  config has it false, where the two agree).
- V3: sigmoid scores plus ``e_score_correction_bias`` to choose (``noaux_tc``), groups
  scored by their best two, weights (without the bias) renormalised when
  ``norm_topk_prob``, then times ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom_core.layers.decoder import GatedMLP
from atom_core.layers.moe import FusedMoE, TopKRouter


class DeepseekV2MLP(GatedMLP):
    """The dense SwiGLU block of the first layers; named as transformers does."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act=hidden_act)


def routing_options(config: Any, version: int) -> dict[str, Any]:
    """TopKRouter keyword arguments for a DeepSeek-V2 (version 2) or V3 (3) config."""
    top_k = config.num_experts_per_tok
    scaling = float(getattr(config, "routed_scaling_factor", None) or 1.0)
    norm = bool(getattr(config, "norm_topk_prob", False))
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if version == 2:
        grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        renormalize = norm and top_k > 1
        return dict(
            scoring_func=getattr(config, "scoring_func", None) or "softmax",
            renormalize=renormalize,
            num_expert_group=n_group if grouped else None,
            topk_group=topk_group if grouped else None,
            correction_bias=False,
            routed_scaling_factor=1.0 if renormalize else scaling,
        )
    return dict(
        scoring_func=getattr(config, "scoring_func", None) or "sigmoid",
        renormalize=norm,
        num_expert_group=n_group,
        topk_group=topk_group,
        correction_bias=(getattr(config, "topk_method", None) or "noaux_tc") == "noaux_tc",
        routed_scaling_factor=scaling,
    )


class DeepseekV2MoE(nn.Module):
    """``experts(x, *gate(x))``, the experts holding the shared experts too (see above): the
    same sum as transformers' ``experts(x, ...) + shared_experts(x)``."""

    def __init__(self, config: Any, version: int) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        num_experts = config.n_routed_experts
        self.gate = TopKRouter(
            hidden, num_experts, config.num_experts_per_tok, **routing_options(config, version)
        )
        n_shared = getattr(config, "n_shared_experts", None) or 0
        self.experts = FusedMoE(num_experts, hidden, inter, num_shared_experts=n_shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))
