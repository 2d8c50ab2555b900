"""The ``clamped_swiglu_moe`` op's reference: routed experts with biases and the clamped
SwiGLU (gpt-oss), over model-dtype or MXFP4 weights.

``clamped_swiglu_moe(hidden [T, H], w13 [E, 2I, H], w13_bias [E, 2I], w2 [E, H, I],
w2_bias [E, H], topk_weights [T, k], topk_ids [T, k], alpha, limit) -> [T, H]``: each
token's output is the sum over its k chosen experts e of ``topk_weights[t, j] *
(w2[e] @ act(w13[e] @ x + w13_bias[e]) + w2_bias[e])``. The rows of w13 interleave gate
and up (row 2i is gate i, row 2i + 1 up i), as gpt-oss ships them, and

    act: gate = min(gate, limit), up = clamp(up, -limit, limit),
         (up + 1) * gate * sigmoid(alpha * gate).

A bias may be None (a tensor-parallel rank other than 0 adds no w2_bias). Ids outside
``[0, E)`` contribute nothing. ``w13`` / ``w2`` may be ``Mxfp4Weight`` stacks: each expert's
weight is then dequantized to the activations' dtype as it is used (weight-only at every
step size; see ``atom_core.quant.mxfp4`` for the bound from which a kernel may quantize
the activations instead). Outputs are summed in fp32. The per-expert loop reads the
experts used on the host: the CPU path and the kernels' yardstick, never a GPU kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.quant.mxfp4 import Mxfp4Weight


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved -> [..., I]."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _expert_linear(x: torch.Tensor, w: torch.Tensor | Mxfp4Weight, expert: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    weight = w.expert(expert).dequantize(x.dtype) if isinstance(w, Mxfp4Weight) else w[expert]
    return F.linear(x, weight, None if bias is None else bias[expert])


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
) -> torch.Tensor:
    top_k = topk_ids.shape[1]
    flat_ids, flat_weights = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in flat_ids.unique().tolist():
        if not 0 <= expert < w13.shape[0]:
            continue
        slots = (flat_ids == expert).nonzero()[:, 0]
        tokens = slots // top_k
        act = clamped_swiglu(_expert_linear(hidden[tokens], w13, expert, w13_bias), alpha, limit)
        y = _expert_linear(act, w2, expert, w2_bias)
        out.index_add_(0, tokens, y.float() * flat_weights[slots, None])
    return out.to(hidden.dtype)
