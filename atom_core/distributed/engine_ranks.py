"""Rank 0's side of a tensor-parallel engine (``-tp`` N > 1): its node's other ranks started
(or a launcher's joined), the group joined, a step run on every rank, and the ranks
stopped with the engine. ``LLMEngine`` holds an ``EngineRanks`` and knows nothing else of
how the ranks run (workers.py: the ranks' side)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from atom_core.config import Config
from atom_core.distributed.launch import (
    check_devices,
    launched_rank,
    node_ranks,
    rank_device,
    rendezvous,
)
from atom_core.distributed.state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    tensor_parallel,
)
from atom_core.distributed.workers import COLLECTIVE_FAILURE_WAIT_S, RankWorkers
from atom_core.errors import ConfigError, EngineDeadError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineRanks:
    """The ranks of one engine, this process rank 0. ``device``: rank 0's device (on GPUs
    the node's GPU of its local rank)."""

    def __init__(self, owner: object, config: Config, device: torch.device) -> None:
        par = config.parallel_config
        check_devices(par, device)
        launched = launched_rank(par)
        if launched is not None and launched.rank != 0:
            raise ConfigError(f"this process is rank {launched.rank} of a launched group "
                              "(RANK): only rank 0 runs the engine; run `atom serve` on "
                              "every rank")
        if launched is not None:  # the launcher started the other ranks
            workers = RankWorkers(config, [], par.tensor_parallel_size, "env://",
                                  par.enable_expert_parallel)
        else:
            workers = RankWorkers(config, node_ranks(par, 0)[1:], par.tensor_parallel_size,
                                  rendezvous(par), par.enable_expert_parallel)
        try:
            self.device = rank_device(device, launched.local_rank if launched else 0)
            init_tensor_parallel(0, workers.size, workers.init_method, self.device,
                                 expert_parallel=workers.expert_parallel)
        except BaseException:
            workers.close(timeout=0)
            raise
        if self.device.type == "cuda":
            workers.watch(_abort_group)
        self.workers = workers
        # The ranks stop with ``owner`` (the engine) if it is collected without shutdown().
        self._stop = weakref.finalize(owner, _stop_workers, workers)

    def send(self, message: Any) -> None:
        """To every other rank (a step's batch, BUILD_RUNNER, a profiler order)."""
        self.workers.send(message)

    def run_step(self, batch: Any, execute: Callable[[], T]) -> T:
        """``execute()`` here after ``batch`` went to the other ranks, which run it too;
        EngineDeadError where a rank died meanwhile (its collectives did not complete, so
        the step's tokens are not sound)."""
        self.workers.send(batch)
        try:
            out = execute()
        except RuntimeError:  # a collective whose peer is gone
            self.workers.broken = True
            self.workers.check(wait=COLLECTIVE_FAILURE_WAIT_S)
            raise
        if self.workers.broken:  # an aborted NCCL group
            self.workers.check(wait=COLLECTIVE_FAILURE_WAIT_S)
            raise EngineDeadError("a tensor-parallel rank is gone")
        return out

    def shutdown(self) -> None:
        self._stop()


def _abort_group(rank: int, code: int) -> None:
    """From the workers' watch: end the NCCL collective waiting on the dead rank (the step
    then fails, and the engine with it)."""
    logger.error("tensor-parallel rank %d died (exit code %d): aborting the group", rank, code)
    group = tensor_parallel().group
    if group is None:
        return
    try:
        group.abort()
    except (AttributeError, RuntimeError) as exc:  # a torch without ProcessGroup.abort
        logger.error("could not abort the group (%s): the step waits for NCCL's timeout", exc)


def _stop_workers(workers: RankWorkers) -> None:
    try:
        workers.check()
    except EngineDeadError:
        workers.broken = True
    if workers.broken:  # a collective failed: another could wait forever, so none is tried
        workers.close(timeout=0)
    else:
        workers.stop()
        workers.close()
    destroy_tensor_parallel()
