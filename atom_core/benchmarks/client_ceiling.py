"""The benchmark client's own ceiling: streams and chunks/s it sustains against a server
that costs nothing (fake_server in a subprocess).

    python -m atom_core.benchmarks.client_ceiling [--streams 1000] [--tokens 256] [--json out.json]

Two runs. "instant": every response is written in one go, so the only work per chunk is the
client's (read a line, parse JSON, take a timestamp): chunks/s is the client's ceiling.
"held": every stream stays open ``--hold-s`` seconds with chunks at a fixed interval and all
``--streams`` requests sent at once, so that many streams are in flight together; the peak
in-flight count and the ITL excess over the server's interval show whether the client kept up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from atom_core.benchmarks.benchmark_serving import benchmark, raise_fd_limit
from atom_core.benchmarks.datasets import SampleRequest


def peak_in_flight(starts: list[float], latencies: list[float]) -> int:
    """The most requests open at one instant (intervals [start, start + latency])."""
    events = sorted([(s, 1) for s in starts] + [(s + lat, -1) for s, lat in zip(starts, latencies)])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def start_fake_server(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "atom_core.benchmarks.fake_server", "--port", "0", *flags],
        stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.search(r"http://\S+", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"fake server did not start: {line!r}")
    return proc, m.group(0)


def run_case(name: str, streams: int, tokens: int, num_prompts: int, server_flags: list[str],
             max_concurrency: int | None) -> dict[str, Any]:
    proc, url = start_fake_server(*server_flags)
    try:
        requests = [SampleRequest("hello", 1, tokens)] * num_prompts
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = asyncio.run(benchmark(
            backend="vllm", api_url=f"{url}/v1/completions", base_url=url, model_id="fake",
            model_name=None, requests=requests, max_concurrency=max_concurrency, disable_tqdm=True,
            selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
            selected_percentiles=[50, 99],
        ))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        proc.terminate()
        proc.wait()
    chunks = sum(len(itl) + 1 for itl, n in zip(result["itls"], result["output_lens"]) if n)
    row = {
        "case": name,
        "requests": num_prompts,
        "completed": result["completed"],
        "tokens_per_request": tokens,
        "max_concurrency": max_concurrency,
        "peak_in_flight": peak_in_flight(result["start_times"], result["e2els"]),
        "chunks": chunks,
        "duration_s": result["duration"],
        "chunks_per_s": chunks / result["duration"],
        "client_cpu_util": cpu / wall,
        "mean_itl_ms": result["mean_itl_ms"],
        "p99_itl_ms": result["p99_itl_ms"],
        "mean_ttft_ms": result["mean_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"],
    }
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=256, help="chunks per instant stream")
    parser.add_argument("--rounds", type=int, default=4,
                        help="instant run: requests = rounds * streams")
    parser.add_argument("--hold-s", type=float, default=5.0,
                        help="held run: seconds each stream stays open")
    parser.add_argument("--hold-interval-ms", type=float, default=50.0,
                        help="held run: ms between chunks")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    raise_fd_limit()
    rows = [run_case("instant", args.streams, args.tokens, args.rounds * args.streams, [],
                     args.streams)]
    held_tokens = max(2, int(args.hold_s * 1000 / args.hold_interval_ms))
    rows.append(run_case("held", args.streams, held_tokens, args.streams,
                         ["--chunk-interval-ms", str(args.hold_interval_ms)], None))
    print(f"\ncpus: {os.cpu_count()}  python {sys.version.split()[0]}")
    print(f"{'case':<8} {'streams':>8} {'peak':>6} {'chunks':>9} {'chunks/s':>10} "
          f"{'client cpu':>10} {'mean ITL ms':>11} {'p99 ITL ms':>10}")
    for r in rows:
        print(f"{r['case']:<8} {r['requests']:>8} {r['peak_in_flight']:>6} {r['chunks']:>9} "
              f"{r['chunks_per_s']:>10.0f} {r['client_cpu_util']:>10.2f} {r['mean_itl_ms']:>11.2f} "
              f"{r['p99_itl_ms']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
