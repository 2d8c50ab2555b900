"""``atom serve -dp 2``: two engine replicas behind one frontend. Concurrent greedy requests
are spread over both (each replica's process works) and answer what one engine answers
(an in-process LLMEngine on the same model)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from atom_core.config import Config
from atom_core.engine.client import EngineClient
from atom_core.engine.llm_engine import LLMEngine
from atom_core.engine.profiler import rank_trace_dir
from atom_core.entrypoints.server_process import ServerProcess, cpu_seconds
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

PROMPTS = [f"prompt number {i} says" for i in range(8)]
MAX_TOKENS = 16


def complete_all(srv: ServerProcess) -> list[str]:
    def one(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.mark.slow
@pytest.mark.parametrize("kind, flags", [
    ("llama", []),
    # MLA attention on each replica's own requests, the experts split across the two.
    ("deepseek_v2", ["--enable-dp-attention"]),
])
def test_two_replicas_share_the_requests_and_answer_as_one(tmp_path, kind, flags):
    model = tiny_model_dir(kind)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    one = LLMEngine(str(model), device="cpu", enable_log_stats=False, max_model_len=256)
    want = [o["text"] for o in one.generate(PROMPTS, params)]
    two = ServerProcess(model, "--device", "cpu", "--max-model-len", "256", "-dp", "2",
                        *flags, log=tmp_path / "server.log").wait_ready()
    try:
        engines = two.engine_pids()
        assert len(engines) == 2
        before = [cpu_seconds(pid) for pid in engines]
        start = time.monotonic()
        got = complete_all(two)
        worked = [cpu_seconds(pid) - b for pid, b in zip(engines, before)]
        # The same wall time again with no requests: what polling the links costs.
        before = [cpu_seconds(pid) for pid in engines]
        time.sleep(time.monotonic() - start)
        idle = [cpu_seconds(pid) - b for pid, b in zip(engines, before)]
    finally:
        two.stop()
    assert got == want
    # Each replica computed some of the requests: an idle engine only polls its link (under
    # DP attention it also serves its experts to the other's steps). Measured against that
    # idle cost on this machine, at least one clock tick (10 ms), not a fixed CPU time.
    assert min(worked) > 5 * max(*idle, 0.01), (worked, idle)
    # The replicas stopped together, each told by the frontend or by the other.
    assert two.proc.returncode == 0, two.log()


@pytest.mark.parametrize("dp, tp, traces", [
    (1, 1, ["/t/rank_0"]),
    (1, 2, ["/t/rank_0", "/t/rank_1"]),
    (2, 2, ["/t/dp1_tp0/rank_2", "/t/dp1_tp1/rank_3"]),
])
def test_each_replica_is_one_engine_with_traces_of_its_own(dp, tp, traces):
    config = Config.from_kwargs(data_parallel_size=dp, tensor_parallel_size=tp,
                                torch_profiler_dir="/t", device="cpu")
    replica = EngineClient.replica_configs(config)[-1]
    par = replica.parallel_config
    assert par.data_parallel_rank == (dp - 1 if dp > 1 else None)
    got = [str(rank_trace_dir("/t", t, tp, par.data_parallel_rank)) for t in range(tp)]
    assert got == traces


def test_dp_attention_replicas_meet_on_one_port():
    config = Config.from_kwargs(data_parallel_size=2, enable_dp_attention=True, device="cpu")
    ports = {r.parallel_config.master_port for r in EngineClient.replica_configs(config)}
    assert len(ports) == 1 and None not in ports
