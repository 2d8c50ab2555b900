"""This process's place in the tensor-parallel group.

One process per rank; ``init_tensor_parallel`` joins the default torch.distributed group
(gloo on CPU, NCCL on GPUs, one GPU a rank) and records it for the layers, which read
``tp_rank_and_size`` when they are built and split their weights accordingly. With no group
initialised a process is a group of one (rank 0 of 1), and every collective is the identity.

A second group, ``control`` (gloo), carries rank 0's orders to the other ranks
(``workers.py``). Its waits, and the data group's, have a timeout of weeks: a worker waits
in a broadcast for as long as the engine idles. A rank that dies closes its connections,
which its peers see at once. NCCL does not see a peer's death: a collective waiting on a
dead rank waits until ``NCCL_TIMEOUT``, or until rank 0, which watches its workers
(``workers.py``), aborts the group. Data collectives never wait for an idle engine, so that
timeout can be short.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(weeks=4)
# Longer than any one step (a first step compiles kernels): a collective that waits more has
# lost a peer.
NCCL_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: dist.ProcessGroup | None  # None: a group of one
    # MoE experts split across the ranks, each whole (--enable-expert-parallel), rather
    # than every expert's intermediate size split.
    expert_parallel: bool = False
    control: dist.ProcessGroup | None = None  # gloo: rank 0's orders to the others
    # DP attention (--enable-dp-attention): the ranks are engine replicas, each with its own
    # requests and the whole model but for the MoE experts, split across them. Only the MoE
    # layers use the group (``collectives.gather_rows``); to every other layer this process
    # is a group of one.
    dp_attention: bool = False


_state = TensorParallel(0, 1, None)


def init_tensor_parallel(rank: int, size: int, init_method: str,
                         device: torch.device | None = None, expert_parallel: bool = False,
                         dp_attention: bool = False) -> None:
    """Join a tensor-parallel group of ``size`` processes as ``rank`` (``init_method``: a
    torch.distributed URL, ``tcp://host:port``, ``file://path`` or ``env://``), its data on
    ``device`` (NCCL for a GPU, else gloo); with ``dp_attention`` the group is DP
    attention's (experts split, nothing else)."""
    global _state
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside a group of {size}")
    if size > 1:
        if not dist.is_initialized():
            if device is not None and device.type == "cuda":
                dist.init_process_group("nccl", init_method=init_method, rank=rank,
                                        world_size=size, timeout=NCCL_TIMEOUT,
                                        device_id=device)
                # The communicator is made by its first collective, which must not be one
                # that a CUDA graph is capturing.
                dist.all_reduce(torch.zeros(1, device=device))
                torch.cuda.synchronize(device)
            else:
                dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                        world_size=size, timeout=IDLE_TIMEOUT)
        control = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_TIMEOUT)
        _state = TensorParallel(rank, size, dist.group.WORLD, expert_parallel or dp_attention,
                                control, dp_attention)
    else:
        _state = TensorParallel(0, 1, None)


def destroy_tensor_parallel() -> None:
    """Leave the group (the process is a group of one again)."""
    global _state
    if _state.group is not None and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError as exc:  # a group aborted after a rank died
            logging.getLogger(__name__).warning("leaving the tensor-parallel group: %s", exc)
    _state = TensorParallel(0, 1, None)


def tensor_parallel() -> TensorParallel:
    return _state


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the group size ((0, 1) without a group, or
    under DP attention, whose group splits only the MoE experts)."""
    if _state.dp_attention:
        return 0, 1
    return _state.rank, _state.size
