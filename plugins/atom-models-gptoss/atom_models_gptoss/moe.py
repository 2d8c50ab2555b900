"""gpt-oss's mixture of experts: a router with a bias whose top-k logits are softmaxed, and
experts with biases and the clamped SwiGLU, over the core's ``clamped_swiglu_moe`` op.

The experts' weights load as the checkpoint ships them. MXFP4 (config.json's
``quantization_config.quant_method`` "mxfp4", as openai/gpt-oss-* are published): each
``<proj>_blocks`` / ``<proj>_scales`` pair is kept packed (``atom_core.quant.mxfp4``) and
dequantized per expert as the op uses it. Unquantized (what transformers writes once it
has dequantized them): the stacks ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H],
stored transposed, as [N, K] for ``F.linear``. Either way the rows of w13 interleave gate
and up, as shipped, so a tensor-parallel rank's slice of the intermediate size is one
contiguous run of rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom_core.distributed.collectives import all_reduce
from atom_core.distributed.state import tensor_parallel
from atom_core.errors import ConfigError
from atom_core.layers.context import get_build_context
from atom_core.layers.linear import ReplicatedLinear, default_weight_loader
from atom_core.ops import resolve_op
from atom_core.quant.mxfp4 import BLOCK, Mxfp4Weight, bf16_bound


def is_mxfp4(config: Any) -> bool:
    """Whether the checkpoint ships its experts as MXFP4."""
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    return quant.get("quant_method") == "mxfp4"


class GptOssRouter(ReplicatedLinear):
    """HF's ``mlp.router``: logits ``x @ weight.T + bias``; a token's experts are its top-k
    logits, weighted by their softmax (over those k alone)."""

    quantizable = False  # --quantization fp8 leaves routers as they are

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden_size, num_experts, bias=True)
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = self(x).topk(self.top_k, dim=-1)
        return values.float().softmax(dim=-1), ids


class GptOssExperts(nn.Module):
    """HF's ``mlp.experts``: ``w13_weight`` [E, 2I, H] (gate and up rows interleaved) and
    ``w2_weight`` [E, H, I] with ``w13_bias`` [E, 2I] and ``w2_bias`` [E, H]; with
    ``mxfp4``, the weights are the packed bytes and ``w13_weight_scale`` /
    ``w2_weight_scale`` their scales. Under tensor parallelism a rank holds a slice of I of
    every expert, and the ranks' outputs are summed (rank 0 adds ``w2_bias``)."""

    def __init__(self, config: Any, mxfp4: bool) -> None:
        super().__init__()
        tp = tensor_parallel()
        if tp.size > 1 and (tp.expert_parallel or tp.dp_attention):
            raise ConfigError("gpt-oss runs with plain tensor parallelism only (no expert "
                              "parallelism or DP attention yet)")
        self.tp_rank, self.tp_size = tp.rank, tp.size
        inter, hidden = config.intermediate_size, config.hidden_size
        experts = config.num_local_experts
        unit = BLOCK * tp.size if mxfp4 else tp.size  # an MXFP4 rank slices whole scale groups
        if inter % unit:
            raise ConfigError(f"the experts' intermediate size {inter} does not split into "
                              f"{tp.size} (--tensor-parallel-size) slices of whole "
                              f"{'32-element groups' if mxfp4 else 'rows'}")
        self.inter = inter // tp.size
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(config.swiglu_limit)
        self.mxfp4 = mxfp4
        w13, w2 = (experts, 2 * self.inter, hidden), (experts, hidden, self.inter)
        if mxfp4:
            self.w13_weight = _param(*w13[:2], hidden // 2, dtype=torch.uint8)
            self.w13_weight_scale = _param(*w13[:2], hidden // BLOCK, dtype=torch.uint8)
            self.w2_weight = _param(*w2[:2], self.inter // 2, dtype=torch.uint8)
            self.w2_weight_scale = _param(*w2[:2], self.inter // BLOCK, dtype=torch.uint8)
            self.bf16_bound = bf16_bound()
        else:
            self.w13_weight, self.w2_weight = _param(*w13), _param(*w2)
        self.w13_bias, self.w2_bias = _param(*w13[:2]), _param(*w2[:2])
        self._op = resolve_op("clamped_swiglu_moe", get_build_context().device)

    def load(self, part: str, tensor: torch.Tensor) -> str:
        """Load the checkpoint's ``mlp.experts.<part>``; returns the parameter's name."""
        rows = slice_of(self.tp_rank, 2 * self.inter)  # w13's rows: gate and up, interleaved
        cols = slice_of(self.tp_rank, self.inter)  # w2's inputs
        groups = slice_of(self.tp_rank, self.inter // BLOCK)
        how = {
            "gate_up_proj": ("w13_weight", lambda t: t.transpose(1, 2)[:, rows]),
            "gate_up_proj_bias": ("w13_bias", lambda t: t[:, rows]),
            "down_proj": ("w2_weight", lambda t: t.transpose(1, 2)[..., cols]),
            "down_proj_bias": ("w2_bias", lambda t: t),
            "gate_up_proj_blocks": ("w13_weight", lambda t: t[:, rows].flatten(-2)),
            "gate_up_proj_scales": ("w13_weight_scale", lambda t: t[:, rows]),
            "down_proj_blocks": ("w2_weight", lambda t: t[:, :, groups].flatten(-2)),
            "down_proj_scales": ("w2_weight_scale", lambda t: t[..., groups]),
        }
        if part not in how or not hasattr(self, how[part][0]):
            kind = "an MXFP4" if self.mxfp4 else "an unquantized"
            raise ValueError(f"experts tensor {part!r} does not fit {kind} checkpoint's experts")
        name, select = how[part]
        default_weight_loader(getattr(self, name), select(tensor))
        return name

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2 = self.w13_weight, self.w2_weight
        if self.mxfp4:
            w13 = Mxfp4Weight(w13, self.w13_weight_scale, self.bf16_bound)
            w2 = Mxfp4Weight(w2, self.w2_weight_scale, self.bf16_bound)
        w2_bias = self.w2_bias if self.tp_rank == 0 else None
        out = self._op(x, w13, self.w13_bias, w2, w2_bias, topk_weights, topk_ids,
                       self.alpha, self.limit)
        return all_reduce(out) if self.tp_size > 1 else out

    def extra_repr(self) -> str:
        fmt = f"mxfp4, bf16 below {self.bf16_bound} tokens" if self.mxfp4 else "unquantized"
        return f"experts={self.w13_weight.shape[0]}, inter={self.inter}, {fmt}"


class GptOssMoE(nn.Module):
    """HF's ``mlp``: the router's choice, then the experts."""

    def __init__(self, config: Any, mxfp4: bool) -> None:
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts,
                                   config.num_experts_per_tok)
        self.experts = GptOssExperts(config, mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.router.route(x))


def slice_of(rank: int, size: int) -> slice:
    return slice(rank * size, (rank + 1) * size)


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
