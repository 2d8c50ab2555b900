"""The sublayers of a pre-norm block as the fused step sees them: where their input is
first projected, and which op produces their output.

A sublayer takes part in the fusion when its shape is one of these (plain model code has
them without saying so):
- attention whose input goes only through ``qkv_proj`` (a column-parallel linear) and
  whose output is ``o_proj``'s (a ``RowParallelLinear``), returned as it is;
- the core's ``GatedMLP``;
- a mixture-of-experts block of exactly a ``gate`` (``TopKRouter``) and ``experts``
  (``FusedMoE``) whose output is the experts'.

Their modules then change class, not names or parameters: the input projection hands on
a ``Projected`` result (the block ran it together with the norm before it), and the
output op takes the ``AddNorm`` left in its ``pending`` by the block
(``atom_core.ops.deferred_norm``). A sublayer of any other shape runs as written.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch
from torch import nn

from atom_core.distributed.collectives import all_reduce
from atom_core.layers.decoder import GatedMLP
from atom_core.layers.linear import LinearBase, RowParallelLinear
from atom_core.layers.moe import FusedMoE, TopKRouter
from atom_core.ops import resolve_op
from atom_core.ops.deferred_norm import AddNorm, DeferredNorm


class Projected(NamedTuple):
    """A sublayer's input whose first projection already ran: ``out`` is its result."""

    out: torch.Tensor


class TakesProjected:
    """Mixed into the input projection: a ``Projected`` input is handed on as it is."""

    def forward(self, x: torch.Tensor | DeferredNorm | Projected) -> torch.Tensor:
        if isinstance(x, Projected):
            return x.out
        return super().forward(x)


class FinishesNorm:
    """Mixed into a sublayer's last op: the block's ``pending`` request to finish the next
    norm goes to the op (which may return a ``DeferredNorm``), once."""

    pending: AddNorm | None = None

    def forward(self, *args: Any) -> torch.Tensor | DeferredNorm:
        add_norm, self.pending = self.pending, None
        return super().forward(*args, add_norm=add_norm)


class FusedGatedMLP(GatedMLP):
    """``GatedMLP`` with the activation folded into the down projection (the
    ``silu_and_mul_linear`` op: one kernel fewer at decode), which may finish the next
    norm."""

    pending: AddNorm | None = None

    def forward(self, x: torch.Tensor | DeferredNorm | Projected) -> torch.Tensor | DeferredNorm:
        add_norm, self.pending = self.pending, None
        down = self.down_proj
        # As RowParallelLinear.forward: rank 0 adds the bias, the ranks' products are summed
        # before any residual add.
        bias = down.bias if down.tp_rank == 0 else None
        if down.tp_size > 1:
            return all_reduce(self._silu_and_mul_linear(self.gate_up_proj(x), down.op_weight,
                                                        bias))
        return self._silu_and_mul_linear(self.gate_up_proj(x), down.op_weight, bias,
                                         add_norm=add_norm)


@cache
def _with(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` before it, under ``cls``'s own name (what a reader of the
    module tree or a log recognises)."""
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (mixin, cls), names)


def _swap(module: nn.Module, mixin: type) -> None:
    if not isinstance(module, mixin):
        module.__class__ = _with(mixin, type(module))


class Parts(NamedTuple):
    """How the block drives one sublayer: ``input_proj`` (None: the sublayer reads the
    normed rows itself) and ``finisher`` (where ``pending`` goes)."""

    input_proj: nn.Module | None
    finisher: nn.Module


def _is_attention(m: nn.Module) -> bool:
    return isinstance(getattr(m, "qkv_proj", None), LinearBase) and isinstance(
        getattr(m, "o_proj", None), RowParallelLinear
    )


def _is_moe(m: nn.Module) -> bool:
    children = dict(m.named_children())
    return (
        set(children) == {"gate", "experts"}
        and isinstance(children["gate"], TopKRouter)
        and isinstance(children["experts"], FusedMoE)
    )


def fuse_sublayer(m: nn.Module, device: torch.device | str) -> Parts | None:
    """Prepare ``m`` for the fused block and say how to drive it; None where its shape is
    not one the fusion knows (it then runs as written)."""
    if _is_attention(m):
        _swap(m.qkv_proj, TakesProjected)
        _swap(m.o_proj, FinishesNorm)
        return Parts(m.qkv_proj, m.o_proj)
    if isinstance(m, GatedMLP):
        if type(m) is GatedMLP:
            m.__class__ = FusedGatedMLP
        elif not isinstance(m, FusedGatedMLP):
            m.__class__ = _with(FusedGatedMLP, type(m))
        m._silu_and_mul_linear = resolve_op("silu_and_mul_linear", device)
        _swap(m.gate_up_proj, TakesProjected)
        return Parts(m.gate_up_proj, m)
    if _is_moe(m):
        _swap(m.experts, FinishesNorm)
        return Parts(None, m.experts)
    return None
