"""Timing on the GPU for the kernel benches: calls captured back to back in one CUDA graph."""

from __future__ import annotations

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
