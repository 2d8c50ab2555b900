"""Mixture-of-experts: the router (``TopKRouter``, HF's ``gate``) and the routed experts
(``FusedMoE``, HF's ``experts``) over the registry's ``fused_moe`` op.

Models compose them: ``weights, ids = gate(x); out = experts(x, weights, ids)``. A shared
expert (DeepSeek's ``shared_experts``) folds into the same call: a SwiGLU MLP of
intermediate size n*I is exactly the sum of n SwiGLU experts of size I (its gate/up rows
and down columns cut into n chunks), so ``FusedMoE(..., num_shared_experts=n)`` stacks n
more experts after the routed ones and every token selects them with weight 1.0. One
grouped GEMM pair then does what took a second MLP's three launches and an add.

``load_hf_moe_weights`` is ``load_hf_weights`` that also understands per-expert checkpoint
tensors (``...experts.<e>.gate_proj.weight`` etc.), transformers' stacked
``...experts.gate_up_proj`` / ``...experts.down_proj``, and the shared MLP's
``...shared_experts.gate_proj.weight`` etc. where the sibling FusedMoE holds shared experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from atom_core.distributed.collectives import all_reduce, gather_rows, sum_own_rows
from atom_core.distributed.state import tensor_parallel
from atom_core.errors import ConfigError
from atom_core.layers.context import get_build_context
from atom_core.layers.linear import allocated, deferrable_weight, store_rows
from atom_core.layers.model_api import STACKED_PARAMS, load_hf_weights
from atom_core.ops import resolve_op
from atom_core.ops.deferred_norm import AddNorm, DeferredNorm, normed
from atom_core.quant.fp8 import FP8_DTYPE, Fp8Weight, quantize_weight


class TopKRouter(nn.Module):
    """The gate, the ``moe_route`` op: fp32 logits ``x @ weight.T``, then the experts'
    choice (see ``atom_core.ops.native.moe.route``). The weight stays fp32 whatever the
    model's dtype (DeepSeek's reference keeps its gate in fp32): it is tiny, and a bf16
    gate would flip near-tied expert choices. x is promoted to fp32 as it is loaded (at
    decode one GEMV instead of a cast and a cuBLAS GEMV)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring_func: str = "softmax",
        renormalize: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if num_expert_group is not None and num_experts % num_expert_group:
            raise ValueError(f"{num_experts} experts do not split into {num_expert_group} groups")
        self.num_experts = num_experts
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.renormalize = renormalize
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("e_score_correction_bias", None)
        self._route = resolve_op("moe_route", get_build_context().device)

    def forward(self, x: torch.Tensor | DeferredNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return self._route(
            x, self.weight, self.top_k, self.scoring_func, self.renormalize, self.num_expert_group,
            self.topk_group, self.e_score_correction_bias, self.routed_scaling_factor,
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring_func}, "
            f"groups={self.num_expert_group}/{self.topk_group}, renormalize={self.renormalize}"
        )


# Checkpoint projection name -> FusedMoE shard: w1 = gate, w3 = up (the two halves of w13),
# w2 = down. HF names (gate_proj/up_proj/down_proj) and Mixtral's (w1/w3/w2) both occur.
EXPERT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
                 "w1": "w1", "w3": "w3", "w2": "w2"}
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)"
    r"\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# A shared-expert MLP beside the experts: ``<prefix>.shared_experts`` next to ``<prefix>.experts``.
_SHARED = re.compile(
    r"^(?P<prefix>.*)\.shared_experts\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class FusedMoE(nn.Module):
    """The experts' weights, stacked: ``w13_weight`` [E, 2I, H] (gate rows, then up rows)
    and ``w2_weight`` [E, H, I]; ``forward(x, topk_weights, topk_ids)`` runs the
    ``fused_moe`` op. With ``num_shared_experts`` n, E counts n always-selected experts
    after the ``num_experts`` routed ones (see the module docstring). ``quantize_fp8``
    (after loading) swaps both stacks for e4m3 values and per-(expert, row) scales.

    With tensor parallelism each rank holds a slice of I of every expert; with expert
    parallelism (``atom_core.distributed.state``) each rank holds whole experts instead: its
    range of the routed ones, and the shared experts j with j % ranks == rank. Either way
    the ranks' partial outputs are summed (one all-reduce, as for RowParallelLinear); under
    expert parallelism a token's choices outside this rank's range become -1, which the op
    skips."""

    # The two stacks as the op takes them once quantized (``quantize_fp8``).
    fp8: tuple[Fp8Weight, Fp8Weight] | None = None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_shared_experts: int = 0,
    ) -> None:
        super().__init__()
        tp = tensor_parallel()
        self.tp_size = tp.size  # the ranks whose outputs are summed
        # DP attention: the ranks hold different tokens; each gathers all of them for its
        # experts, and takes back the sum of its own rows (``forward``).
        self.dp_attention = tp.dp_attention
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        # The slice of I this rank holds: all of it under expert parallelism.
        self.tp_rank, self.inter_ranks = (0, 1) if self.expert_parallel else (tp.rank, tp.size)
        if intermediate_size % self.inter_ranks:
            raise ConfigError(f"the experts' intermediate size {intermediate_size} does not "
                              f"split evenly into {tp.size} (--tensor-parallel-size)")
        if self.expert_parallel and num_experts % tp.size:
            raise ConfigError(f"{num_experts} experts do not split evenly across {tp.size} "
                              "expert-parallel ranks")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size // self.inter_ranks
        # This rank's routed experts [expert_start, expert_start + local_experts) and shared
        # experts (indices into the model's), stacked in that order.
        self.local_experts = num_experts // tp.size if self.expert_parallel else num_experts
        self.expert_start = tp.rank * self.local_experts if self.expert_parallel else 0
        self.total_shared = num_shared_experts
        self.shared_ids = [j for j in range(num_shared_experts)
                           if not self.expert_parallel or j % tp.size == tp.rank]
        self.num_shared_experts = len(self.shared_ids)
        inter, total = self.intermediate_size, self.local_experts + self.num_shared_experts
        self.w13_weight = deferrable_weight(total, 2 * inter, hidden_size)
        self.w2_weight = deferrable_weight(total, hidden_size, inter)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self._op = resolve_op("fused_moe", get_build_context().device)
        if self.dp_attention:
            self._rms_norm = resolve_op("rms_norm", get_build_context().device)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """One expert's ``w1`` (gate [I, H]), ``w3`` (up [I, H]) or ``w2`` (down [H, I]); or,
        with ``expert_id`` None, the routed experts' whole stacked tensor ([E, 2I, H] or
        [E, H, I]). ``expert_id`` counts the model's experts (shared ones after the routed);
        an expert another rank holds is skipped."""
        inter, rank = self.intermediate_size, self.tp_rank
        if expert_id is None:
            loaded_weight = loaded_weight.narrow(0, self.expert_start, self.local_experts)
            if param is self.w13_weight:  # [E, 2I, H]: slice each half for this rank
                gate, up = loaded_weight.chunk(2, dim=1)
                loaded_weight = torch.cat(
                    (gate.narrow(1, rank * inter, inter), up.narrow(1, rank * inter, inter)), dim=1
                )
            else:
                loaded_weight = loaded_weight.narrow(2, rank * inter, inter)
            return store_rows(param, (slice(0, self.local_experts),), loaded_weight)
        slot = self.local_slot(expert_id)
        if slot is None:
            return
        if shard_id == "w2":
            store_rows(param, (slot,), loaded_weight.narrow(1, rank * inter, inter))
        elif shard_id in ("w1", "w3"):
            start = 0 if shard_id == "w1" else inter
            store_rows(param, (slot, slice(start, start + inter)),
                       loaded_weight.narrow(0, rank * inter, inter))
        else:
            raise ValueError(f"FusedMoE shard_id must be 'w1', 'w2' or 'w3', got {shard_id!r}")

    def local_slot(self, expert_id: int) -> int | None:
        """Where the model's expert ``expert_id`` (shared ones after the routed) sits in this
        rank's stacks; None where another rank holds it."""
        if expert_id >= self.num_experts:
            shared = expert_id - self.num_experts
            if shared not in self.shared_ids:
                return None
            return self.local_experts + self.shared_ids.index(shared)
        local = expert_id - self.expert_start
        return local if 0 <= local < self.local_experts else None

    def shared_weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str
    ) -> None:
        """The shared MLP's whole ``w1`` (gate [n*I, H]), ``w3`` (up [n*I, H]) or ``w2``
        (down [H, n*I]): chunk j of I is shared expert j, loaded as expert num_experts + j."""
        dim, full = (1 if shard_id == "w2" else 0), self.intermediate_size * self.inter_ranks
        if not self.total_shared or loaded_weight.shape[dim] != self.total_shared * full:
            raise ValueError(
                f"shared expert tensor of shape {tuple(loaded_weight.shape)} does not fit "
                f"{self.total_shared} shared experts of intermediate size {full}"
            )
        for j, chunk in enumerate(loaded_weight.split(full, dim=dim)):
            self.weight_loader(param, chunk, shard_id, self.num_experts + j)

    def quantize_fp8(self, w8a8_min_rows: int) -> None:
        """Replace ``w13_weight`` and ``w2_weight`` (same names) by their e4m3 values, with
        one fp32 scale per expert and output row in ``w13_weight_scale`` [E, 2I] and
        ``w2_weight_scale`` [E, H]; the model-dtype stacks are freed. Shared experts are in
        the stacks and are quantized with them."""
        fp8 = []
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(self, name).data
            qweight = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            # Expert by expert: the fp32 temporaries of a whole stack would be twice its size.
            for e in range(weight.shape[0]):
                expert = quantize_weight(weight[e])
                qweight[e], scale[e] = expert.qweight, expert.scale
            del weight
            setattr(self, name, nn.Parameter(qweight, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
            fp8.append(Fp8Weight(getattr(self, name), getattr(self, f"{name}_scale"),
                                 w8a8_min_rows))
        self.fp8 = (fp8[0], fp8[1])

    def allocate_weights(self, device: torch.device, dtype: torch.dtype,
                         w8a8_min_rows: int | None) -> None:
        """Give the deferred stacks their storage before loading: e4m3 with per-(expert,
        row) scales where ``w8a8_min_rows`` is given (as ``quantize_fp8`` would leave them,
        each expert's rows quantized as the loader copies them), else ``dtype``."""
        fp8 = []
        for name in ("w13_weight", "w2_weight"):
            weight, quantized = allocated(getattr(self, name).shape, device, dtype,
                                          w8a8_min_rows)
            weight.weight_loader = self.weight_loader
            setattr(self, name, weight)
            if quantized is not None:
                setattr(self, f"{name}_scale", weight.quantize_on_load.scale)
                fp8.append(quantized)
        if fp8:
            self.fp8 = (fp8[0], fp8[1])

    def forward(
        self, x: torch.Tensor | DeferredNorm | None, topk_weights: torch.Tensor | None,
        topk_ids: torch.Tensor | None, add_norm: AddNorm | None = None,
    ) -> torch.Tensor | DeferredNorm:
        """``topk_weights`` / ``topk_ids`` [T, k]: the routed choices; the op adds the shared
        experts' slots itself. ``add_norm``: as ``RowParallelLinear.forward``'s. All three
        None: DP attention's idle pass (``idle_moe_pass``)."""
        w13, w2 = (self.w13_weight, self.w2_weight) if self.fp8 is None else self.fp8
        if self.dp_attention:
            if isinstance(x, DeferredNorm):
                x = normed(x, self._rms_norm)
            (x, topk_weights, topk_ids), sizes = gather_rows(x, topk_weights, topk_ids)
            if not x.shape[0]:  # no rank has tokens (a rank's idle pass beside idle ones)
                return x
        if self.expert_parallel:
            local = topk_ids - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.local_experts), local, -1)
        if self.dp_attention:
            return sum_own_rows(self._op(x, w13, w2, topk_weights, topk_ids,
                                         num_shared_experts=self.num_shared_experts), sizes)
        if self.tp_size > 1:  # each rank's experts hold a slice of I: sum the partial outputs
            return all_reduce(self._op(x, w13, w2, topk_weights, topk_ids,
                                       num_shared_experts=self.num_shared_experts))
        return self._op(x, w13, w2, topk_weights, topk_ids,
                        num_shared_experts=self.num_shared_experts, add_norm=add_norm)

    def extra_repr(self) -> str:
        quant = ", fp8" if self.fp8 is not None else ""
        return (
            f"experts={self.num_experts}, shared={self.num_shared_experts}, "
            f"hidden={self.hidden_size}, inter={self.intermediate_size}{quant}"
        )


def _stack_name(moe: str, shard: str) -> str:
    return f"{moe}.{'w2_weight' if shard == 'w2' else 'w13_weight'}"


def load_hf_moe_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: Iterable[tuple[str, str, str | int]] = STACKED_PARAMS,
    skip: tuple[str, ...] = ("rotary_emb.inv_freq",),
) -> set[str]:
    """``load_hf_weights``, with expert tensors routed into their FusedMoE's stacked
    parameters. A stacked parameter counts as loaded once every expert's (routed and
    shared) every part is, so a missing one leaves it out of the returned names."""
    params = dict(model.named_parameters())
    moes = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    loaded: set[str] = set()
    parts: dict[str, set[tuple[int, str]]] = {}

    owner = {f"{name}.{stack}": m for name, m in moes.items()
             for stack in ("w13_weight", "w2_weight")}

    def mark(target: str, got_parts: Iterable[tuple[int, str]]) -> None:
        # Only the experts this rank holds count (all of them without expert parallelism).
        got = parts.setdefault(target, set())
        got.update((e, s) for e, s in got_parts if owner[target].local_slot(e) is not None)
        if len(got) == params[target].shape[0] * (1 if target.endswith("w2_weight") else 2):
            loaded.add(target)

    def non_expert() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _PER_EXPERT.match(name)
            if m is not None and m["prefix"] in moes:
                moe, shard, expert = moes[m["prefix"]], EXPERT_SHARDS[m["proj"]], int(m["expert"])
                if not 0 <= expert < moe.num_experts:
                    raise ValueError(f"checkpoint tensor {name!r}: the model has "
                                     f"{moe.num_experts} routed experts")
                target = _stack_name(m["prefix"], shard)
                params[target].weight_loader(params[target], tensor, shard, expert)
                mark(target, [(expert, shard)])
                continue
            m = _STACKED.match(name)
            if m is not None and m["prefix"] in moes:
                shards = ("w2",) if m["proj"] == "down_proj" else ("w1", "w3")
                target = _stack_name(m["prefix"], shards[0])
                params[target].weight_loader(params[target], tensor)
                mark(target, [(e, s) for e in range(moes[m["prefix"]].num_experts) for s in shards])
                continue
            m = _SHARED.match(name)
            moe = moes.get(f"{m['prefix']}.experts") if m is not None else None
            if m is not None and moe is not None and moe.num_shared_experts:
                shard = EXPERT_SHARDS[m["proj"]]
                target = _stack_name(f"{m['prefix']}.experts", shard)
                moe.shared_weight_loader(params[target], tensor, shard)
                mark(target, [(moe.num_experts + j, shard) for j in range(moe.total_shared)])
                continue
            yield name, tensor

    loaded |= load_hf_weights(model, non_expert(), stacked_params, skip)
    return loaded


def idle_moe_pass(model: nn.Module) -> int:
    """DP attention: a rank with no tokens in a step still takes its part in every MoE
    layer's exchange, in the order the forward runs them (the modules' order), computing
    its experts for the other ranks' tokens. Returns how many layers it joined."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer in layers:
        layer.forward(None, None, None)
    return len(layers)
