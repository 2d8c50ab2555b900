"""This process's place in the tensor-parallel group.

One process per rank; ``init_tensor_parallel`` joins the default torch.distributed group
(gloo on CPU, NCCL on GPUs) and records it for the layers, which read ``tp_rank_and_size``
when they are built and split their weights accordingly. With no group initialised a
process is a group of one (rank 0 of 1), and every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: dist.ProcessGroup | None  # None: a group of one
    # MoE experts split across the ranks, each whole (--enable-expert-parallel), rather
    # than every expert's intermediate size split.
    expert_parallel: bool = False


_state = TensorParallel(0, 1, None)


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str = "gloo",
                         expert_parallel: bool = False) -> None:
    """Join a tensor-parallel group of ``size`` processes as ``rank`` (``init_method``: a
    torch.distributed URL, ``tcp://host:port`` or ``file://path``)."""
    global _state
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside a group of {size}")
    if size > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=size)
        _state = TensorParallel(rank, size, dist.group.WORLD, expert_parallel)
    else:
        _state = TensorParallel(0, 1, None)


def destroy_tensor_parallel() -> None:
    """Leave the group (the process is a group of one again)."""
    global _state
    if _state.group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallel(0, 1, None)


def tensor_parallel() -> TensorParallel:
    return _state


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the group size ((0, 1) without a group)."""
    return _state.rank, _state.size
