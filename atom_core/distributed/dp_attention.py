"""DP attention's lockstep: ``-dp N --enable-dp-attention`` runs N engine replicas (one
process each, behind one frontend), each with its own scheduler, KV cache and requests,
joined in one group whose only collectives are the MoE layers' token exchanges
(``collectives.gather_rows``).

Every exchange needs every replica, so the replicas step together: each loop iteration
they agree (one all-reduce of two flags) whether any has work and whether any was told to
stop. When one has work, all step; a replica whose step runs no forward (it has no
requests, or its step only read a queued one) joins each MoE layer's exchange with no
tokens of its own (``layers.moe.idle_moe_pass``), computing its experts for the others'.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from atom_core.distributed import collectives
from atom_core.distributed.launch import rendezvous
from atom_core.distributed.state import init_tensor_parallel, tensor_parallel
from atom_core.errors import ConfigError

logger = logging.getLogger(__name__)


def join_dp_attention(par: Any) -> None:
    """Join the replicas' group as replica ``data_parallel_rank`` of ``data_parallel_size``,
    at the rendezvous the frontend gave them all."""
    init_tensor_parallel(par.data_parallel_rank, par.data_parallel_size, rendezvous(par),
                         dp_attention=True)


def check_has_moe(model: torch.nn.Module) -> None:
    from atom_core.layers.moe import FusedMoE

    if not any(isinstance(m, FusedMoE) for m in model.modules()):
        raise ConfigError("--enable-dp-attention splits a model's MoE experts across the "
                          "replicas, and this model has none: serve it with plain -dp N")


class Lockstep:
    """One replica's side of the agreement; ``step`` once per engine loop iteration."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.any_busy = False  # the last agreement: some replica had work

    def step(self, stop: bool) -> bool:
        """Agree with the other replicas, then step this engine (or idle) if any has work.
        True when some replica was told to stop: every replica leaves its loop together."""
        busy = not self.engine.is_finished()
        flags = torch.tensor([int(busy), int(stop)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=tensor_parallel().group)
        if flags[1]:
            return True
        self.any_busy = bool(flags[0])
        if self.any_busy:
            before = collectives.row_exchanges
            if busy:
                self.engine.step()
            if collectives.row_exchanges == before:
                from atom_core.layers.moe import idle_moe_pass

                idle_moe_pass(self.engine.runner.model)
        return False
