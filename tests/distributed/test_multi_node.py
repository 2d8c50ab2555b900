"""Two "nodes" on loopback, two tensor-parallel ranks each (``-tp 4 --nnodes 2``): node 0's
``atom serve`` runs the server and ranks 0-1, node 1's (``--node-rank 1``) only ranks 2-3.
The server answers what one process answers, and node 1 exits when node 0 stops."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from atom_core.distributed.workers import free_port
from atom_core.engine.llm_engine import LLMEngine
from atom_core.entrypoints.server_process import ServerProcess
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow

PROMPT = "the two nodes say"


def test_two_nodes_of_two_ranks_answer_as_one_process(tmp_path):
    model = str(tiny_model_dir("llama"))  # 4 query heads, 2 KV heads: 1 and a copy a rank
    want = LLMEngine(model, device="cpu", enable_log_stats=False).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]["text"]
    common = ("--device", "cpu", "--max-model-len", "256", "-tp", "4", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    log1 = open(tmp_path / "node1.log", "w")  # noqa: SIM115 - closed below
    node1 = subprocess.Popen(
        [sys.executable, "-m", "atom_core.entrypoints.server_runtime", "--model", model,
         *common, "--node-rank", "1"], stdout=log1, stderr=subprocess.STDOUT)
    node0 = ServerProcess(model, *common, "--node-rank", "0", log=tmp_path / "node0.log")
    try:
        node0.wait_ready()
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{node0.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        node0.stop()
        try:
            code = node1.wait(timeout=30)
        finally:
            if node1.poll() is None:
                node1.kill()
            log1.close()
    # node 0's engine told its ranks to stop: node 1's exit without an error
    assert code == 0, (tmp_path / "node1.log").read_text()[-2000:]


def test_a_node_rank_outside_the_nodes_is_refused(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "atom_core.entrypoints.server_runtime", "--device", "cpu",
         "-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--node-rank 2 is not one of --nnodes 2" in out.stderr
