"""Benchmark metrics from per-request outputs, and the result block in vLLM's layout.

The block reproduces ``vllm bench serve``'s labels, order and column widths so scripts that
parse its output parse ours. Two lines are ours: "Concurrency:" (sum of per-request E2E
latency / duration, the mean number of requests in flight) and "ITL/TPOT (merge factor):".
ITL is sampled once per received chunk, so a server that merges N tokens into one chunk
inflates every ITL statistic by about N; TPOT = (latency - ttft) / (output_len - 1) stays
token-normalized, and their ratio is the merge factor (1.0: nothing merged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atom_core.benchmarks.backend_request_func import RequestFuncOutput

METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class MetricStats:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
        ms = np.asarray(seconds, dtype=float) * 1000 if len(seconds) else np.zeros(1)
        return cls(float(np.mean(ms)), float(np.median(ms)), float(np.std(ms)),
                   [(p, float(np.percentile(ms, p))) for p in percentiles])


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    concurrency: float
    stats: dict[str, MetricStats] = field(default_factory=dict)

    @property
    def merge_factor(self) -> float | None:
        tpot = self.stats["tpot"].mean
        return self.stats["itl"].mean / tpot if tpot > 0 else None


@dataclass
class RequestRecords:
    """Per-request values, in request order (failed requests: zeros and empty lists)."""

    input_lens: list[int]
    output_lens: list[int]
    ttfts: list[float]
    itls: list[list[float]]
    tpots: list[float]
    e2els: list[float]


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:100", "tpot:50"]`` -> {"ttft": 100.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        try:
            name, value = pair.split(":")
            slos[name] = float(value)
        except ValueError:
            raise ValueError(
                f"invalid --goodput {pair!r}: give KEY:VALUE pairs, "
                "a metric name and a number of ms"
            ) from None
        if name not in GOODPUT_METRICS:
            raise ValueError(
                f"invalid --goodput metric {name!r}: one of {', '.join(GOODPUT_METRICS)}")
        if slos[name] < 0:
            raise ValueError(f"invalid --goodput value for {name}: must be non-negative")
    return slos


def calculate_metrics(
    outputs: Sequence[RequestFuncOutput],
    duration: float,
    percentiles: Sequence[float],
    goodput: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[BenchmarkMetrics, RequestRecords]:
    """Token totals use the server's usage counts when it reported them; otherwise the
    prompt length the client computed and ``count_tokens`` of the generated text."""
    rec = RequestRecords([], [], [], [], [], [])
    ttfts, tpots, itls, e2els, good_tpots = [], [], [], [], []
    for out in outputs:
        if not out.success:
            for lst in (rec.input_lens, rec.output_lens, rec.ttfts, rec.tpots, rec.e2els):
                lst.append(0)
            rec.itls.append([])
            continue
        n_in = out.server_prompt_tokens if out.server_prompt_tokens is not None else out.prompt_len
        n_out = out.output_tokens
        if n_out is None:
            n_out = count_tokens(out.generated_text) if count_tokens else len(out.itl) + 1
        tpot = (out.latency - out.ttft) / (n_out - 1) if n_out > 1 else 0.0
        if n_out > 1:
            tpots.append(tpot)
        good_tpots.append(tpot)  # a one-token answer meets any TPOT SLO
        ttfts.append(out.ttft)
        itls.extend(out.itl)
        e2els.append(out.latency)
        rec.input_lens.append(n_in)
        rec.output_lens.append(n_out)
        rec.ttfts.append(out.ttft)
        rec.itls.append(list(out.itl))
        rec.tpots.append(tpot)
        rec.e2els.append(out.latency)
    completed = len(ttfts)
    good = completed
    if goodput:
        by_name = {"ttft": ttfts, "tpot": good_tpots, "e2el": e2els}
        ok = np.ones(completed, dtype=bool)
        for name, slo_ms in goodput.items():
            ok &= np.asarray(by_name[name]) <= slo_ms / 1000
        good = int(ok.sum())
    total_in, total_out = sum(rec.input_lens), sum(rec.output_lens)
    metrics = BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_in,
        total_output=total_out,
        duration=duration,
        request_throughput=completed / duration,
        request_goodput=good / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        concurrency=sum(e2els) / duration,
        stats={"ttft": MetricStats.of(ttfts, percentiles),
               "tpot": MetricStats.of(tpots, percentiles),
               "itl": MetricStats.of(itls, percentiles),
               "e2el": MetricStats.of(e2els, percentiles)},
    )
    return metrics, rec


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_result(
    m: BenchmarkMetrics,
    selected: Sequence[str],
    goodput: dict[str, float] | None = None,
    accept_length: float | None = None,
    acceptance_rate: float | None = None,
) -> list[str]:
    """The printed block, line by line."""
    row, num = "{:<40} {:<10}".format, "{:<40} {:<10.2f}".format
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        row("Successful requests:", m.completed),
        num("Benchmark duration (s):", m.duration),
        row("Total input tokens:", m.total_input),
        row("Total generated tokens:", m.total_output),
        num("Request throughput (req/s):", m.request_throughput),
    ]
    if goodput:
        lines.append(num("Request goodput (req/s):", m.request_goodput))
    lines += [
        num("Output token throughput (tok/s):", m.output_throughput),
        num("Total Token throughput (tok/s):", m.total_token_throughput),
        num("Concurrency:", m.concurrency),
    ]
    merge = m.merge_factor
    label = "ITL/TPOT (merge factor):"
    lines.append(num(label, merge) if merge is not None else row(label, "n/a"))
    if accept_length is not None:
        lines.append(num("Accept length:", accept_length))
    if acceptance_rate is not None:
        lines.append(num("Acceptance rate (%):", acceptance_rate * 100))
    for key in METRIC_TITLES:
        if key not in selected:
            continue
        name, header = METRIC_TITLES[key]
        s = m.stats[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(num(f"Mean {name} (ms):", s.mean))
        lines.append(num(f"Median {name} (ms):", s.median))
        lines += [num(f"P{_p_word(p)} {name} (ms):", v) for p, v in s.percentiles]
    lines.append("=" * 50)
    return lines


def result_dict(m: BenchmarkMetrics, rec: RequestRecords, selected: Sequence[str],
                goodput: dict[str, float] | None) -> dict[str, Any]:
    """vLLM's result keys (totals, then mean/median/std/pNN per selected metric)."""
    out: dict[str, Any] = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if goodput else None,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "concurrency": m.concurrency,
        "itl_tpot_merge_factor": m.merge_factor,
        "input_lens": rec.input_lens,
        "output_lens": rec.output_lens,
        "ttfts": rec.ttfts,
        "itls": rec.itls,
        "tpots": rec.tpots,
        "e2els": rec.e2els,
    }
    for key in METRIC_TITLES:
        if key not in selected:
            continue
        s = m.stats[key]
        out[f"mean_{key}_ms"] = s.mean
        out[f"median_{key}_ms"] = s.median
        out[f"std_{key}_ms"] = s.std
        for p, v in s.percentiles:
            out[f"p{_p_word(p)}_{key}_ms"] = v
    return out
