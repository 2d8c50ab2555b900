"""`atom bench serve` is registered and takes the benchmark's flags."""

from __future__ import annotations

import math
import subprocess
import sys

from atom_core.entrypoints import bench_cmd
from atom_core.entrypoints.cli import build_parser


def test_atom_bench_serve_parses_the_guide_example():
    args = build_parser().parse_args([
        "bench", "serve", "--model=deepseek-ai/DeepSeek-R1", "--backend=vllm",
        "--base-url=http://localhost:8000", "--dataset-name=random", "--random-input-len=1024",
        "--random-output-len=1024", "--random-range-ratio", "0.8", "--num-prompts=1280",
        "--max-concurrency=128", "--request-rate=inf", "--ignore-eos",
        "--save-result", "--percentile-metrics=ttft,tpot,itl,e2el", "--result-dir=./",
        "--result-filename=Deepseek-R1-result.json",
    ])
    assert args.func is bench_cmd.run
    parsed = (args.random_range_ratio, args.max_concurrency, args.ignore_eos, args.save_result)
    assert parsed == (0.8, 128, True, True)
    assert math.isinf(args.request_rate) and args.goodput is None and args.profile is False


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "atom_core.benchmarks.benchmark_serving", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--burstiness", "--goodput", "--metric-percentiles", "--random-prefix-len",
                 "--use-chat-template", "--result-filename", "--profile", "--tokenizer", "--seed"):
        assert flag in out
