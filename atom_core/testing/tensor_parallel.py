"""A model's logits with its layers split across tensor-parallel ranks on CPU (gloo), for
the check that they equal one process's: one spawned process per rank, each loading the
same checkpoint into its slice and running the same steps over its own paged KV cache."""

from __future__ import annotations

import queue
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from atom_core.config import Config
from atom_core.distributed.state import destroy_tensor_parallel, init_tensor_parallel
from atom_core.layers.context import forward_context
from atom_core.layers.moe import idle_moe_pass
from atom_core.loader import load_model
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches

Steps = list[list[list[int]]]  # per step, per sequence: the new token ids


def model_logits(path: str, steps: Steps, **config: object) -> tuple[list[torch.Tensor], int]:
    """(each step's fp32 logits [new tokens, vocab], the weights' element count) of the model
    at ``path`` in this process's tensor-parallel group."""
    model = load_model(Config.from_kwargs(model=path, **config), "cpu", torch.float32).model
    return step_logits(model, steps), sum(p.numel() for p in model.parameters())


def step_logits(model: torch.nn.Module, steps: Steps) -> list[torch.Tensor]:
    """Each step's fp32 logits [new tokens, vocab] of ``model`` (CPU, fp32) over a fresh
    paged KV cache. Under DP attention an empty step is this rank's idle pass (None)."""
    kv = PagedKV(num_blocks=64, block_size=4, seed=1)
    allocate_kv_caches(model, kv, torch.float32, "cpu")
    ids = [kv.add_sequence() for _ in next(new for new in steps if new)]
    out = []
    for new in steps:
        if not new:
            idle_moe_pass(model)
            out.append(None)
            continue
        meta, positions = kv.step(ids, [len(t) for t in new])
        flat = torch.tensor([t for chunk in new for t in chunk])
        with torch.no_grad(), forward_context(meta):
            out.append(model.compute_logits(model(flat, positions)).clone())
    return out


def _rank_main(rank: int, size: int, init_method: str, jobs: list[tuple[str, dict]],
               steps: Steps | list[Steps], results: mp.Queue, expert_parallel: bool,
               dp_attention: bool) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, size, init_method, expert_parallel=expert_parallel,
                         dp_attention=dp_attention)
    try:
        for i, (path, config) in enumerate(jobs):
            # numpy arrays travel by value: a tensor through the queue would live in this
            # process's shared memory, gone once it exits.
            logits, held = model_logits(path, steps[rank] if dp_attention else steps, **config)
            results.put((rank, i, [None if t is None else t.numpy() for t in logits], held))
    finally:
        destroy_tensor_parallel()


def tensor_parallel_logits(jobs: list[tuple[str, dict]], steps: Steps | list[Steps],
                           size: int = 2, expert_parallel: bool = False,
                           dp_attention: bool = False,
                           ) -> list[list[tuple[list[torch.Tensor | None], int]]]:
    """For each job (checkpoint path, Config keywords): every rank's ``model_logits``, run
    in ``size`` spawned processes joined by gloo (MoE experts split whole across them with
    ``expert_parallel``); ``[job][rank]``. With ``dp_attention`` the group is DP
    attention's and ``steps[r]`` are rank r's own steps (all ranks the same number of them;
    an empty one is that rank's idle pass)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [ctx.Process(target=_rank_main,
                             args=(r, size, init_method, jobs, steps, results,
                                   expert_parallel, dp_attention))
                 for r in range(size)]
        for p in procs:
            p.start()
        got: dict[tuple[int, int], tuple[list[torch.Tensor], int]] = {}
        try:
            while len(got) < size * len(jobs):
                try:
                    rank, i, logits, held = results.get(timeout=5)
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        codes = [p.exitcode for p in procs]
                        raise RuntimeError(f"tensor-parallel ranks exited early: {codes}"
                                           ) from None
                    continue
                got[(rank, i)] = ([None if a is None else torch.from_numpy(a) for a in logits],
                                  held)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [[got[(r, i)] for r in range(size)] for i in range(len(jobs))]
