"""``atom serve -tp 2`` started by torchrun, one process per rank: rank 0 serves and rank 1
is its worker. The server answers what one process answers; SIGTERM to torchrun stops every
process. A launch that does not fit the flags is one error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from atom_core.config import Config
from atom_core.distributed.launch import LaunchedRank, launched_rank
from atom_core.distributed.workers import free_port
from atom_core.engine.llm_engine import LLMEngine
from atom_core.entrypoints.server_process import ServerProcess
from atom_core.entrypoints.server_process import free_port as free_server_port
from atom_core.errors import ConfigError
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

PROMPT = "torchrun placed the ranks"
LAUNCHER_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


def _parallel(monkeypatch, env: dict[str, str], **kwargs):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Config.from_kwargs(device="cpu", **kwargs).parallel_config


def test_the_launchers_environment_places_this_rank(monkeypatch):
    par = _parallel(monkeypatch, LAUNCHER_ENV, tensor_parallel_size=2)
    assert launched_rank(par) == LaunchedRank(rank=1, world_size=2, local_rank=1)
    # One rank, or no launcher: the engine starts its own workers.
    assert launched_rank(_parallel(monkeypatch, LAUNCHER_ENV)) is None
    assert launched_rank(_parallel(monkeypatch, {}, tensor_parallel_size=2)) is None


@pytest.mark.parametrize("env, kwargs, error", [
    ({"WORLD_SIZE": "4"}, {}, "started 4 processes .WORLD_SIZE. for --tensor-parallel-size 2"),
    ({"WORLD_SIZE": "two"}, {}, "WORLD_SIZE is missing or not a number"),
    ({"MASTER_PORT": None}, {}, "MASTER_PORT is not"),
    ({}, {"nnodes": 2}, "drop --nnodes, --node-rank and -dp"),
])
def test_a_launch_that_does_not_fit_the_flags_is_one_error(monkeypatch, env, kwargs, error):
    merged = {k: v for k, v in {**LAUNCHER_ENV, **env}.items() if v is not None}
    par = _parallel(monkeypatch, merged, tensor_parallel_size=2, **kwargs)
    with pytest.raises(ConfigError, match=error):
        launched_rank(par)


def test_an_engine_on_a_launched_rank_other_than_0_is_refused(monkeypatch):
    _parallel(monkeypatch, LAUNCHER_ENV)
    with pytest.raises(ConfigError, match="only rank 0 runs the engine"):
        LLMEngine(str(tiny_model_dir("llama")), device="cpu", tensor_parallel_size=2)


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_torchrun_starts_a_server_that_answers_as_one_process(tmp_path):
    model = str(tiny_model_dir("llama"))
    want = LLMEngine(model, device="cpu", enable_log_stats=False).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]["text"]
    port = free_server_port()
    log = open(tmp_path / "torchrun.log", "w")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "atom_core.entrypoints.server_runtime", "--model", model, "--device", "cpu",
         "-tp", "2", "--max-model-len", "256", "--host", "127.0.0.1",
         "--server-port", str(port), "--disable-uvicorn-access-log"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    # Only its readiness poll: the process is torchrun's.
    server = ServerProcess.__new__(ServerProcess)
    server.proc, server.log_path, server.base_url = (
        launcher, tmp_path / "torchrun.log", f"http://127.0.0.1:{port}")
    try:
        server.wait_ready()
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        launcher.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks
        launcher.wait(timeout=60)  # non-zero: torchrun reports the signal it was stopped by
        deadline = time.monotonic() + 10
        while _session_pids(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session_pids(launcher.pid) == []  # no rank, engine or worker left behind
    finally:
        if launcher.poll() is None or _session_pids(launcher.pid):
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()
    # Rank 1 followed rank 0's stop rather than losing its peer.
    assert "rank 1 exiting" not in (tmp_path / "torchrun.log").read_text()
