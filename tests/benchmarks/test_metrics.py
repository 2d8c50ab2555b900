"""Metrics from per-request outputs, checked against numpy, and the vLLM result block."""

from __future__ import annotations

import numpy as np
import pytest

from atom_core.benchmarks.backend_request_func import RequestFuncOutput
from atom_core.benchmarks.metrics import (
    calculate_metrics,
    format_result,
    parse_goodput,
    result_dict,
)

# The block of `vllm bench serve`, in order (P-lines for --metric-percentiles 50,99.9).
EXPECTED_LABELS = [
    "Successful requests:", "Benchmark duration (s):", "Total input tokens:",
    "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
    "Output token throughput (tok/s):",
    "Total Token throughput (tok/s):", "Concurrency:", "ITL/TPOT (merge factor):",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P50 TTFT (ms):", "P99.9 TTFT (ms):",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P50 TPOT (ms):", "P99.9 TPOT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P50 ITL (ms):", "P99.9 ITL (ms):",
    "Mean E2EL (ms):", "Median E2EL (ms):", "P50 E2EL (ms):", "P99.9 E2EL (ms):",
]
SECTIONS = [
    "============ Serving Benchmark Result ============",
    "---------------Time to First Token----------------",
    "-----Time per Output Token (excl. 1st token)------",
    "---------------Inter-token Latency----------------",
    "----------------End-to-end Latency----------------",
    "==================================================",
]


def outputs(seed: int = 0, n: int = 40) -> list[RequestFuncOutput]:
    rng = np.random.default_rng(seed)
    outs = []
    for i in range(n):
        n_out = int(rng.integers(1, 30))
        itl = rng.exponential(0.02, n_out - 1).tolist()
        ttft = float(rng.exponential(0.1))
        outs.append(RequestFuncOutput(success=i % 13 != 5, ttft=ttft, itl=itl,
                                      latency=ttft + sum(itl), output_tokens=n_out,
                                      server_prompt_tokens=100 + i, prompt_len=99 + i))
    return outs


def test_metrics_match_an_independent_computation():
    outs = outputs()
    ok = [o for o in outs if o.success]
    m, rec = calculate_metrics(outs, 12.5, [25, 50, 99])
    assert m.completed == len(ok) and m.failed == len(outs) - len(ok)
    assert m.total_input == sum(o.server_prompt_tokens for o in ok)  # the server's count wins
    assert m.total_output == sum(o.output_tokens for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl]
    for key, values in {"ttft": [o.ttft for o in ok], "tpot": tpots, "itl": itls,
                        "e2el": [o.latency for o in ok]}.items():
        ms = np.array(values) * 1000
        s = m.stats[key]
        assert s.mean == pytest.approx(ms.mean()) and s.median == pytest.approx(np.median(ms))
        assert s.std == pytest.approx(ms.std())
        assert s.percentiles == [(p, pytest.approx(np.percentile(ms, p))) for p in (25, 50, 99)]
    assert m.concurrency == pytest.approx(sum(o.latency for o in ok) / 12.5)
    assert m.merge_factor == pytest.approx(np.mean(itls) / np.mean(tpots))
    assert rec.output_lens[5] == 0 and rec.itls[5] == []  # a failed request counts nothing


def test_merge_factor_reads_chunk_merging():
    # 4 tokens per chunk, 10 ms apart: ITL 10 ms, TPOT 2.5 ms, merge factor 4.
    out = RequestFuncOutput(success=True, ttft=0.05, itl=[0.01] * 7, latency=0.05 + 0.07,
                            output_tokens=29)
    m, _ = calculate_metrics([out], 1.0, [99])
    assert m.stats["tpot"].mean == pytest.approx(70 / 28)
    assert m.merge_factor == pytest.approx(4.0)


def test_goodput_counts_requests_within_every_slo():
    outs = [RequestFuncOutput(success=True, ttft=t, latency=t + 0.1, itl=[0.05, 0.05],
                              output_tokens=3)
            for t in (0.01, 0.2, 0.05)]
    slos = parse_goodput(["ttft:100", "tpot:60"])
    m, _ = calculate_metrics(outs, 2.0, [99], slos)
    assert m.request_goodput == pytest.approx(2 / 2.0)
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft=5"])


def test_result_block_has_vllm_labels_order_and_widths():
    m, rec = calculate_metrics(outputs(), 3.0, [50, 99.9])
    lines = format_result(m, ["ttft", "tpot", "itl", "e2el"], goodput={"ttft": 100})
    assert [ln for ln in lines if ln.startswith(("=", "-"))] == SECTIONS
    rows = [ln for ln in lines if not ln.startswith(("=", "-"))]
    assert [ln[:40].rstrip() for ln in rows] == EXPECTED_LABELS
    for ln in rows:  # "{:<40} {:<10}": label padded to 40, a space, value padded to 10
        assert len(ln) >= 51 and ln[40] == " " and ln[:40].rstrip().endswith(":")
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", m.completed)
    assert lines[2] == "{:<40} {:<10.2f}".format("Benchmark duration (s):", 3.0)
    # Only the selected metrics get sections; no goodput line without SLOs.
    short = format_result(m, ["ttft"])
    assert "Request goodput (req/s):" not in "\n".join(short)
    assert not any("TPOT (ms)" in ln or "ITL (ms)" in ln for ln in short)


def test_spec_decode_lines_only_when_reported():
    m, _ = calculate_metrics(outputs(), 3.0, [99])
    assert not any(ln.startswith("Accept") for ln in format_result(m, ["ttft"]))
    lines = format_result(m, ["ttft"], accept_length=2.5, acceptance_rate=0.75)
    assert "{:<40} {:<10.2f}".format("Accept length:", 2.5) in lines
    assert "{:<40} {:<10.2f}".format("Acceptance rate (%):", 75.0) in lines


def test_result_dict_keys():
    m, rec = calculate_metrics(outputs(), 3.0, [99])
    d = result_dict(m, rec, ["ttft", "e2el"], None)
    assert {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p99_e2el_ms"} <= set(d)
    assert "p99_itl_ms" not in d and d["request_goodput"] is None
    assert d["total_input_tokens"] == sum(d["input_lens"])
