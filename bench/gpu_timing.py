"""Timing on the GPU for the kernel benches: calls captured back to back in one CUDA graph."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch


def graph_us(fns: list[Callable[[], Any]], replays: int = 7) -> float:
    """Microseconds per call of ``fns`` run back to back in one CUDA graph (median replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:  # compile and warm outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del graph
    return sorted(times)[len(times) // 2]


def sweep(
    make_calls: Callable[..., list[Callable[[], Any]]], space: list[tuple], out: torch.Tensor,
    describe: Callable[[tuple], dict],
) -> dict:
    """``graph_us(make_calls(*point))`` for every point of ``space``, the first being what
    the op picks today; each row also holds the largest difference of ``out`` from the
    first point's result. {"default": first row, "best": fastest row, "all": rows}."""
    for fn in make_calls(*space[0]):
        fn()
    ref = out.float().clone()
    rows = []
    for point in space:
        us = graph_us(make_calls(*point), replays=20)
        rows.append({**describe(point), "us": us, "max_abs_diff": (out.float() - ref).abs().max().item()})
    return {"default": rows[0], "best": min(rows, key=lambda r: r["us"]), "all": rows}


def run_shapes(names: list[str], measure: Callable[[str], dict], json_path: str) -> None:
    """``measure(name)`` for each shape (its tensors freed before the next), the results to
    ``json_path`` by name."""
    results = {}
    for name in names:
        results[name] = measure(name)
        torch.cuda.empty_cache()
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)


def shape_args(doc: str, json_path: str, shapes: list[str], choice: str) -> argparse.Namespace:
    """The kernel benches' command line: --json (default ``json_path``), --default-only (time
    only the op's own split count and ``choice``), --shapes (of ``shapes``, all by default)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--json", default=json_path)
    p.add_argument("--default-only", action="store_true", help=f"time only today's split count and {choice}")
    p.add_argument("--shapes", nargs="+", choices=shapes, default=shapes)
    return p.parse_args()
