"""Where the tensor-parallel ranks run: ``--nnodes`` machines, ``tp / nnodes`` ranks each,
meeting at ``--master-addr:--master-port`` (torch.distributed's conventions; the
``MASTER_ADDR`` / ``MASTER_PORT`` environment variables stand in for the flags).

Node 0 runs the server and the engine (rank 0) and its next ranks; each other node runs
``atom serve --node-rank R`` with the same model and flags, which starts only that node's
ranks (``run_node``) and exits when they do.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from atom_core.distributed.workers import RankWorkers, free_port

logger = logging.getLogger(__name__)


def node_ranks(par: Any, node_rank: int) -> range:
    """The tensor-parallel ranks node ``node_rank`` runs."""
    per_node = par.tensor_parallel_size // par.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


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
