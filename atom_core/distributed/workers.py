"""The tensor-parallel ranks other than the engine (rank 0): started as child processes of
the engine for its own node, or of ``atom serve --node-rank R`` on another node.

Rank 0 schedules; every step it broadcasts the scheduled batch over the group's control
channel (gloo, ``state.py``), and all ranks run the same model runner on it, so their
collectives meet in the same order (rank 0's sampled tokens are the ones kept). A worker's
start-up arguments come on its stdin (one pickled message, then end-of-file). A rank that
dies closes its connections: the others' next broadcast or gloo collective fails at once,
the engine with ``EngineDeadError`` (naming the rank when it is a child of this process) and
a worker by exiting, so no worker outlives the engine. An NCCL collective does not see the
death: on GPUs rank 0 watches its workers (``watch``) and aborts the data group when one
exits, which ends the collective waiting on it.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from atom_core.distributed.state import tensor_parallel
from atom_core.errors import EngineDeadError

logger = logging.getLogger(__name__)

# Rank 0's first order: build the model runner, which every rank does together (its KV
# planning and graph captures run collectives).
BUILD_RUNNER = "build-runner"

# After a failed collective: how long to wait for a worker's exit, to name the rank that died.
COLLECTIVE_FAILURE_WAIT_S = 1.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_rank(par: Any, rank: int) -> int:
    """``rank``'s place among its node's ranks: which of the node's GPUs it takes."""
    return rank % (par.tensor_parallel_size // par.nnodes)


def broadcast(message: Any) -> Any:
    """Rank 0's ``message`` on every rank (the others pass None and get it)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=tensor_parallel().control)
    return box[0]


class RankWorkers:
    """Start the worker processes of ``ranks`` (each runs ``atom_core.distributed.worker``)
    for a group of ``size`` meeting at ``init_method``."""

    def __init__(self, config: Any, ranks: Sequence[int], size: int, init_method: str,
                 expert_parallel: bool) -> None:
        self.ranks = list(ranks)
        self.size = size
        self.init_method = init_method
        self.expert_parallel = expert_parallel
        self.procs: list[subprocess.Popen] = []
        self.broken = False  # a broadcast or collective failed: the group is unusable
        self._closing = threading.Event()
        try:
            for rank in self.ranks:
                proc = subprocess.Popen([sys.executable, "-m", "atom_core.distributed.worker"],
                                        stdin=subprocess.PIPE, env=os.environ.copy())
                self.procs.append(proc)
                proc.stdin.write(pickle.dumps((rank, size, init_method, config, expert_parallel,
                                               local_rank(config.parallel_config, rank))))
                proc.stdin.close()
        except BaseException:
            self.close()
            raise

    def watch(self, on_death: Callable[[int, int], None], period: float = 0.05) -> None:
        """From a daemon thread, call ``on_death(rank, exit code)`` once, when the first of
        these workers exits before ``close``; ``broken`` is set first."""
        def run() -> None:
            while not self._closing.wait(period):
                for rank, proc in zip(self.ranks, list(self.procs)):
                    code = proc.poll()
                    if code is not None and not self._closing.is_set():
                        self.broken = True
                        on_death(rank, code)
                        return

        threading.Thread(target=run, name="tp-worker-watch", daemon=True).start()

    def send(self, message: Any) -> None:
        """``message`` to every other rank (from rank 0)."""
        self.check()
        try:
            broadcast(message)
        except RuntimeError as exc:  # a peer closed its connections
            self.broken = True
            self.check(wait=COLLECTIVE_FAILURE_WAIT_S)
            raise EngineDeadError(f"a tensor-parallel rank is gone: {exc}") from None

    def check(self, wait: float = 0.0) -> None:
        """EngineDeadError naming the first of these workers that exited, waiting up to
        ``wait`` seconds for one to: a collective that failed saw a peer's sockets close,
        which can come just before that peer's exit status exists."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in zip(self.ranks, self.procs):
                code = proc.poll()
                if code is not None:
                    raise EngineDeadError(f"tensor-parallel rank {rank} died (exit code {code})")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def wait(self) -> int:
        """Wait for every worker to exit; the first non-zero exit code, else 0."""
        codes = [proc.wait() for proc in self.procs]
        return next((c for c in codes if c), 0)

    def stop(self) -> None:
        """From rank 0: tell every other rank to exit (their broadcast gets None)."""
        self._closing.set()  # their exits are no deaths
        try:
            broadcast(None)
        except RuntimeError:  # some are gone already
            pass

    def close(self, timeout: float = 10.0) -> None:
        """End the workers: they exit when the group's rank 0 stops (``stop``) or is gone;
        those still running after ``timeout`` are killed."""
        self._closing.set()
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not stop; killing it",
                               proc.pid)
                proc.kill()
                proc.wait()
        self.procs = []
