"""Where the tensor-parallel ranks run: ``--nnodes`` machines, ``tp / nnodes`` ranks each,
meeting at ``--master-addr:--master-port`` (torch.distributed's conventions; the
``MASTER_ADDR`` / ``MASTER_PORT`` environment variables stand in for the flags).

Node 0 runs the server and the engine (rank 0) and its next ranks; each other node runs
``atom serve --node-rank R`` with the same model and flags, which starts only that node's
ranks (``run_node``) and exits when they do.

Or a launcher starts every rank (``torchrun --nproc-per-node N -m atom_core.entrypoints.cli
serve -tp N``): rank 0 serves, and every other rank is a worker in the launched process
(``launched_rank``).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch

from atom_core.distributed.workers import RankWorkers, free_port
from atom_core.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a group an outside launcher started, one process per rank
    (torchrun, or anything that sets torch.distributed's ``env://`` variables)."""

    rank: int
    world_size: int
    local_rank: int


def launched_rank(par: Any) -> LaunchedRank | None:
    """With ``-tp`` N > 1 and ``RANK``/``WORLD_SIZE`` set (torchrun sets them, with
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``): this process's rank, its peers
    already started by the launcher; else None. A launch that does not match the flags is
    a ConfigError."""
    if par.tensor_parallel_size == 1 or "RANK" not in os.environ:
        return None
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise ConfigError("RANK is set but WORLD_SIZE is missing or not a number: a "
                          "launcher's environment (torchrun) needs both") from None
    if size != par.tensor_parallel_size:
        raise ConfigError(f"the launcher started {size} processes (WORLD_SIZE) for "
                          f"--tensor-parallel-size {par.tensor_parallel_size}: one process "
                          "per rank, e.g. torchrun --nproc-per-node N ... -tp N")
    if par.nnodes != 1 or par.node_rank != 0 or par.data_parallel_size != 1:
        raise ConfigError("under torchrun the launcher places the ranks: drop --nnodes, "
                          "--node-rank and -dp")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ConfigError(f"RANK and WORLD_SIZE are set but {name} is not")
    return LaunchedRank(rank, size, local)


def node_ranks(par: Any, node_rank: int) -> range:
    """The tensor-parallel ranks node ``node_rank`` runs."""
    per_node = par.tensor_parallel_size // par.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def check_devices(par: Any, device: torch.device) -> None:
    """On GPUs each of a node's ranks takes its own (NCCL runs one rank a device): a
    ConfigError where the node has fewer."""
    if device.type != "cuda":
        return
    per_node = par.tensor_parallel_size // par.nnodes
    count = torch.cuda.device_count()
    if per_node > count:
        raise ConfigError(f"-tp {par.tensor_parallel_size} over {par.nnodes} node(s) runs "
                          f"{per_node} ranks a node, one GPU each, but CUDA sees {count} "
                          "here (CUDA_VISIBLE_DEVICES): lower -tp or add nodes")


def rank_device(device: torch.device, local: int) -> torch.device:
    """The device of the node's rank ``local``: its GPU (made current), or the CPU."""
    if device.type != "cuda":
        return device
    if local >= torch.cuda.device_count():
        raise ConfigError(f"this node's rank {local} needs GPU {local}, but CUDA sees "
                          f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def rendezvous(par: Any) -> str:
    """The group's meeting point: --master-addr/--master-port (or their environment
    variables); a free loopback port where there is one node and no port is given."""
    addr = par.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = par.master_port or os.environ.get("MASTER_PORT")
    if port is None:
        port = free_port()
    return f"tcp://{addr}:{port}"


def run_node(config: Any) -> int:
    """A node other than 0: start its ranks, wait for them; their first non-zero exit code,
    else 0. SIGTERM or Ctrl+C here kills them (their peers then fail the engine)."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    par = config.parallel_config
    ranks = node_ranks(par, par.node_rank)
    workers = RankWorkers(config, ranks, par.tensor_parallel_size, rendezvous(par),
                          par.enable_expert_parallel)
    logger.info("node %d of %d: tensor-parallel ranks %d-%d joining %s", par.node_rank,
                par.nnodes, ranks[0], ranks[-1], workers.init_method)
    try:
        return workers.wait()
    finally:
        workers.close(timeout=0)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_launched(config: Any, launched: LaunchedRank) -> int:
    """A launched rank other than 0: be that rank's worker until rank 0 stops."""
    from atom_core.distributed.worker import run_rank

    par = config.parallel_config
    logger.info("rank %d of %d (started by the launcher) joining env://", launched.rank,
                launched.world_size)
    return run_rank(launched.rank, launched.world_size, "env://", config,
                    par.enable_expert_parallel, launched.local_rank)
