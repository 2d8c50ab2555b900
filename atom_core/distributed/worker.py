"""A tensor-parallel worker (rank >= 1): ``python -m atom_core.distributed.worker``, started
by ``workers.RankWorkers``, or ``run_rank`` in a process a launcher (torchrun) started. Its
stdin holds (rank, size, init_method, config, expert_parallel, local_rank); then rank 0
broadcasts the order to build the model runner (all ranks plan the KV cache together and
capture the same graphs), one scheduled batch per step (and profiler orders between them),
and None to stop."""

from __future__ import annotations

import logging
import pickle
import signal
import sys
from typing import Any

import torch

from atom_core.distributed.state import destroy_tensor_parallel, init_tensor_parallel
from atom_core.distributed.workers import BUILD_RUNNER, broadcast


def main() -> int:
    data = sys.stdin.buffer.read()
    if not data:
        return 0
    return run_rank(*pickle.loads(data))


def run_rank(rank: int, size: int, init_method: str, config: Any, expert_parallel: bool,
             local_rank: int) -> int:
    """Be tensor-parallel rank ``rank`` (>= 1; ``local_rank`` of its node, whose GPU of
    that number it takes) until rank 0 stops: 0, or 1 when a peer is gone."""
    # A signal to the process group (Ctrl+C, a supervisor's SIGTERM) is the engine's or the
    # launcher's to act on: the worker follows rank 0, or is killed by its launcher.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    # Imported here: the engine's modules load the plugins.
    from atom_core.distributed.launch import rank_device
    from atom_core.engine.llm_engine import resolve_device, resolve_dtype
    from atom_core.engine.model_runner import ModelRunner, resolve_block_size
    from atom_core.engine.profiler import ProfileOrder, rank_profiler
    from atom_core.loader import load_model

    mc = config.model_config
    torch.manual_seed(mc.seed)
    device = rank_device(resolve_device(mc.device), local_rank)
    dtype = resolve_dtype(mc.dtype, device)
    init_tensor_parallel(rank, size, init_method, device, expert_parallel=expert_parallel)
    try:
        loaded = load_model(config, device, dtype)
        resolve_block_size(config, loaded.model, device)
        if broadcast(None) != BUILD_RUNNER:  # rank 0 stopped before it built its runner
            return 0
        runner = ModelRunner(config, loaded, device, dtype)
        profiler = rank_profiler(config, rank)
        while (order := broadcast(None)) is not None:
            if isinstance(order, ProfileOrder) and order.start:
                profiler.start()
            elif isinstance(order, ProfileOrder):
                profiler.stop_nowait()  # written by a child process while the steps go on
            else:
                runner.execute(order)
                profiler.step()
        profiler.stop()  # the trace of a profile still running when the engine stopped
    except RuntimeError as exc:  # rank 0 (or another peer) is gone
        logging.getLogger(__name__).warning("rank %d exiting: %s", rank, exc)
        return 1
    finally:
        destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
