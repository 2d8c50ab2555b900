"""The collectives the tensor-parallel layers call: identities in a group of one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from atom_core.distributed.state import tensor_parallel


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel ranks (in place; returns ``x``)."""
    tp = tensor_parallel()
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension, rank 0 first."""
    tp = tensor_parallel()
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)
