"""`atom bench serve` against the real server on CPU (tiny model): its totals agree with the
server's usage and /metrics, its percentiles with numpy, its arrivals with a Poisson process."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re

import httpx
import numpy as np
import pytest

from atom_core.benchmarks import benchmark_serving
from atom_core.benchmarks.arrivals import arrival_intervals
from atom_core.entrypoints.server_process import ServerProcess
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow

BLOCK_LABELS = [
    "Successful requests:", "Benchmark duration (s):", "Total input tokens:",
    "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
    "Output token throughput (tok/s):",
    "Total Token throughput (tok/s):", "Concurrency:", "ITL/TPOT (merge factor):",
    "---------------Time to First Token----------------",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P25 TTFT (ms):", "P50 TTFT (ms):", "P99 TTFT (ms):",
    "-----Time per Output Token (excl. 1st token)------",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P25 TPOT (ms):", "P50 TPOT (ms):", "P99 TPOT (ms):",
    "---------------Inter-token Latency----------------",
    "Mean ITL (ms):", "Median ITL (ms):", "P25 ITL (ms):", "P50 ITL (ms):", "P99 ITL (ms):",
    "----------------End-to-end Latency----------------",
    "Mean E2EL (ms):", "Median E2EL (ms):", "P25 E2EL (ms):", "P50 E2EL (ms):", "P99 E2EL (ms):",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-server")
    srv = ServerProcess(
        tiny_model_dir("llama"), "--max-model-len", "256",
        "--torch-profiler-dir", str(logs / "traces"), log=logs / "server.log",
    ).wait_ready()
    srv.trace_dir = logs / "traces" / "rank_0"
    yield srv
    srv.stop()


def counters(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    out = {}
    for name in ("atom:prompt_tokens_total", "atom:generation_tokens_total",
                 "atom:request_success_total"):
        values = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
        # request_success has one series per finish reason.
        out[name] = sum(float(v) for v in values)
    return out


def bench(server, tmp_path, *flags: str) -> tuple[dict, str]:
    args = ["--model", str(tiny_model_dir("llama")), "--base-url", server.base_url,
            "--dataset-name", "random", "--disable-tqdm", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "r.json", *flags]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert benchmark_serving.main(args) == 0
    return json.loads((tmp_path / "r.json").read_text()), buf.getvalue()


@pytest.fixture(scope="module")
def run(server, tmp_path_factory):
    """One run, with the server's counters read just before and just after it."""
    before = counters(server)
    res, printed = bench(
        server, tmp_path_factory.mktemp("run"), "--num-prompts", "24", "--random-input-len", "40",
        "--random-output-len", "12", "--random-range-ratio", "0.5", "--max-concurrency", "6",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "25,50,99",
        "--goodput", "ttft:60000", "tpot:60000",
    )
    after = counters(server)
    return res, printed, {k: after[k] - before[k] for k in after}


def test_requests_and_tokens_match_usage_and_metrics(run):
    res, _, delta = run
    assert res["completed"] == 24 and res["failed"] == 0
    assert delta["atom:request_success_total"] == 24
    generated = delta["atom:generation_tokens_total"]
    assert res["total_output_tokens"] == sum(res["output_lens"]) == generated
    # Input totals are the server's usage.prompt_tokens, and the client's own count agrees.
    counted = sum(res["tokenizer_input_lens"])
    assert res["total_input_tokens"] == sum(res["server_input_lens"]) == counted
    assert res["tokenizer_input_lens"] == res["server_input_lens"]
    assert all(1 <= n <= 12 for n in res["output_lens"])
    # At least one token a chunk.
    assert all(len(itl) + 1 <= n for itl, n in zip(res["itls"], res["output_lens"]))


def test_input_tokens_match_the_prompt_token_counter(run):
    res, _, delta = run
    assert res["total_input_tokens"] == delta["atom:prompt_tokens_total"]


def test_percentiles_match_numpy_on_the_records(run):
    res, _, _ = run
    ttft, e2el, n_out = (np.array(res[k], dtype=float) for k in ("ttfts", "e2els", "output_lens"))
    multi = n_out > 1
    values = {"ttft": ttft, "tpot": (e2el[multi] - ttft[multi]) / (n_out[multi] - 1),
              "itl": np.array([x for itl in res["itls"] for x in itl]), "e2el": e2el}
    for key, v in values.items():
        ms = v * 1000
        assert res[f"mean_{key}_ms"] == pytest.approx(ms.mean(), rel=1e-9)
        assert res[f"median_{key}_ms"] == pytest.approx(np.median(ms), rel=1e-9)
        assert res[f"std_{key}_ms"] == pytest.approx(ms.std(), rel=1e-9, abs=1e-9)
        for p in (25, 50, 99):
            assert res[f"p{p}_{key}_ms"] == pytest.approx(np.percentile(ms, p), rel=1e-9)
    assert res["concurrency"] == pytest.approx(e2el.sum() / res["duration"])
    assert res["request_goodput"] == pytest.approx(24 / res["duration"])


def test_printed_block_has_vllm_labels_and_order(run):
    res, printed, _ = run
    lines = printed.splitlines()
    top = lines.index("============ Serving Benchmark Result ============")
    end = lines.index("=" * 50, top)
    block = lines[top + 1 : end]
    assert [ln if ln.startswith("-") else ln[:40].rstrip() for ln in block] == BLOCK_LABELS
    rows = dict((ln[:40].rstrip(), ln[41:].strip()) for ln in block if not ln.startswith("-"))
    assert int(rows["Successful requests:"]) == 24
    assert int(rows["Total input tokens:"]) == res["total_input_tokens"]
    assert float(rows["Mean TPOT (ms):"]) == pytest.approx(res["mean_tpot_ms"], abs=0.006)
    assert "Accept length" not in printed  # no speculative decoding: /debug/mtp_stats says so


def test_poisson_arrivals_at_rate_4(server, tmp_path):
    n = 40
    res, printed = bench(server, tmp_path, "--num-prompts", str(n), "--random-input-len", "16",
                         "--random-output-len", "4", "--request-rate", "4", "--burstiness", "1",
                         "--seed", "5")
    assert res["completed"] == n and res["request_rate"] == 4.0
    assert "Burstiness factor: 1.0 (Poisson process)" in printed
    gaps = np.diff(res["dispatch_times"])
    sent_gaps = np.diff(res["start_times"])
    # The requests went out on the schedule the arrival process drew (no drift, no bunching) ...
    planned = arrival_intervals(n, 4.0, 1.0, seed=5)[: n - 1]
    assert np.abs(np.cumsum(gaps) - np.cumsum(planned)).max() < 0.05
    assert np.abs(sent_gaps - gaps).max() < 0.05
    # ... and look like a Poisson process. With 39 gaps the standard error of the mean is
    # 16% and of the CV about 15%; the bounds are ~2.5 standard errors.
    assert gaps.mean() == pytest.approx(0.25, rel=0.4)
    assert 0.6 <= gaps.std() / gaps.mean() <= 1.4


def test_chat_backend_and_profile_flag_write_a_trace(server, tmp_path):
    before = set(os.listdir(server.trace_dir)) if server.trace_dir.exists() else set()
    res, printed = bench(server, tmp_path, "--backend", "openai-chat", "--num-prompts", "4",
                         "--random-input-len", "24", "--random-output-len", "6", "--ignore-eos",
                         "--profile")
    assert "Profiler started" in printed and "Profiler stopped" in printed
    # --ignore-eos: exactly max tokens.
    assert res["completed"] == 4 and res["output_lens"] == [6] * 4
    new = [f for f in set(os.listdir(server.trace_dir)) - before if f.endswith(".json.gz")]
    assert len(new) == 1
    events = json.loads(gzip.open(server.trace_dir / new[0]).read())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
