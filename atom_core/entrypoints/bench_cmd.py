"""``atom bench serve``: the online serving benchmark (atom_core.benchmarks.benchmark_serving)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from atom_core.benchmarks.cli_args import DESCRIPTION, add_cli_args

    bench = sub.add_parser("bench", help="benchmark a running server")
    kinds = bench.add_subparsers(dest="bench_command", metavar="KIND", required=True)
    p = kinds.add_parser(
        "serve", help="online serving benchmark (vLLM's benchmark_serving flags and output)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from atom_core.benchmarks.benchmark_serving import run as run_benchmark

    run_benchmark(args)
    return 0
