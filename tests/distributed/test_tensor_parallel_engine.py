"""``LLMEngine`` with ``-tp 2`` on CPU: a worker process for rank 1, the scheduler on rank 0.
Greedy tokens and their log-probabilities equal one process's; a worker that dies fails
the engine with its rank named, and no worker outlives the engine."""

from __future__ import annotations

import gzip
import json
import os
import signal
import time

import pytest

from atom_core.distributed.workers import RankWorkers
from atom_core.engine.llm_engine import LLMEngine
from atom_core.errors import ConfigError, EngineDeadError
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

PROMPTS = [[5, 9, 3, 7, 1, 2], [11, 2, 8], [4, 4, 6, 10, 12, 14, 16, 18, 20, 22]]
OPTS = dict(device="cpu", enable_log_stats=False, block_size=4, max_model_len=64)


def greedy(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = engine.generate(PROMPTS, params)
    return [(o["token_ids"], [e.logprob for e in o["logprobs"]]) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("kind, extra", [
    ("qwen3", {}), ("qwen3_moe", {}), ("deepseek_v2", {"enable_expert_parallel": True}),
])
def test_two_ranks_generate_what_one_process_does(kind, extra, tmp_path):
    path = str(tiny_model_dir(kind))
    want = greedy(LLMEngine(path, **OPTS))
    # One case also profiles: each rank writes its own trace of the same steps.
    traces = kind == "qwen3"
    if traces:
        extra = {**extra, "torch_profiler_dir": str(tmp_path)}
    engine = LLMEngine(path, tensor_parallel_size=2, **extra, **OPTS)
    try:
        if traces:
            engine.start_profile()
        got = greedy(engine)
        if traces:
            engine.stop_profile()
    finally:
        engine.shutdown()
    if traces:
        for rank in (0, 1):
            (trace,) = (tmp_path / f"rank_{rank}").glob("*.json.gz")
            names = {e.get("name") for e in json.loads(gzip.open(trace).read())["traceEvents"]}
            assert any(n and n.startswith("decode[") for n in names), sorted(names)[:20]
    for (g_ids, g_lps), (w_ids, w_lps) in zip(got, want):
        assert g_ids == w_ids
        assert g_lps == pytest.approx(w_lps, abs=1e-4)


@pytest.mark.slow
def test_a_dead_worker_fails_the_engine_and_none_is_left_behind():
    engine = LLMEngine(str(tiny_model_dir("llama")), tensor_parallel_size=2, **OPTS)
    worker = engine.ranks.workers.procs[0]
    greedy(engine)  # all ranks working
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 died"):
        greedy(engine)
    assert time.monotonic() - start < 5
    engine.shutdown()

    engine = LLMEngine(str(tiny_model_dir("llama")), tensor_parallel_size=2, **OPTS)
    worker = engine.ranks.workers.procs[0]
    engine.shutdown()
    assert worker.poll() == 0  # stopped when asked


def test_more_ranks_than_gpus_is_one_error_before_any_worker_starts(monkeypatch):
    import torch

    import atom_core.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started = []
    monkeypatch.setattr(RankWorkers, "__init__", lambda self, *a, **k: started.append(a))
    with pytest.raises(ConfigError, match="-tp 2 over 1 node.s. runs 2 ranks a node, one GPU "
                                          "each, but CUDA sees 1"):
        LLMEngine(str(tiny_model_dir("llama")), tensor_parallel_size=2, **OPTS)
    assert started == []


def _agree(rank: int, init_method: str, value: int, out) -> None:
    from atom_core.distributed.collectives import min_over_ranks
    from atom_core.distributed.state import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(rank, 2, init_method)
    out.put((rank, min_over_ranks(value)))
    destroy_tensor_parallel()


def test_ranks_agree_on_the_least_kv_blocks_any_of_them_fits(tmp_path):
    """Each rank plans its cache from its own GPU's free memory; all keep the least."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_agree, args=(r, init, v, out)) for r, v in ((0, 700), (1, 300))]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: 300, 1: 300}


def test_a_gpu_workers_death_is_seen_without_a_collective():
    """NCCL does not notice a dead peer: rank 0 watches its workers' processes."""
    import subprocess
    import sys
    import threading

    workers = RankWorkers.__new__(RankWorkers)
    workers.ranks = [1]
    workers.procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])]
    workers.broken = False
    workers._closing = threading.Event()
    seen = []
    died = threading.Event()
    workers.watch(lambda rank, code: (seen.append((rank, code)), died.set()))
    assert died.wait(5)
    assert seen == [(1, 0)] and workers.broken


@pytest.mark.slow
def test_heads_that_do_not_split_are_one_error_and_stop_the_workers(monkeypatch):
    """The embedded SmolLM2 has 9 attention heads: -tp 2 cannot split them."""
    started = []
    init = RankWorkers.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        started.extend(self.procs)

    monkeypatch.setattr(RankWorkers, "__init__", record)
    with pytest.raises(ConfigError, match="the attention heads: 9 does not split evenly into 2"):
        LLMEngine(tensor_parallel_size=2, **OPTS)
    assert len(started) == 1 and started[0].poll() is not None
