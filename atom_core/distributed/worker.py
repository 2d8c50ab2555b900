"""A tensor-parallel worker (rank >= 1): ``python -m atom_core.distributed.worker``, started
by the engine (``workers.RankWorkers``), which writes its orders to this process's stdin:
(rank, size, init_method, config, expert_parallel), then the KV cache's block count, then
one scheduled batch per step, and None to stop."""

from __future__ import annotations

import logging
import sys

import torch

from atom_core.distributed.state import destroy_tensor_parallel, init_tensor_parallel
from atom_core.distributed.workers import read_message


def main() -> int:
    stdin = sys.stdin.buffer
    try:
        rank, size, init_method, config, expert_parallel = read_message(stdin)
    except EOFError:
        return 0
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    # Imported after the group's arguments: the engine's modules load the plugins.
    from atom_core.engine.llm_engine import resolve_device, resolve_dtype
    from atom_core.engine.model_runner import ModelRunner
    from atom_core.loader import load_model

    mc = config.model_config
    torch.manual_seed(mc.seed)
    device = resolve_device(mc.device)
    dtype = resolve_dtype(mc.dtype, device)
    init_tensor_parallel(rank, size, init_method, expert_parallel=expert_parallel)
    try:
        loaded = load_model(config, device, dtype)
        config.cache_config.num_gpu_blocks_override = read_message(stdin)
        runner = ModelRunner(config, loaded, device, dtype)
        while (batch := read_message(stdin)) is not None:
            runner.execute(batch)
    except EOFError:  # the engine is gone
        return 0
    finally:
        destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
