"""When each request is sent: gamma-distributed gaps at --request-rate, shaped by --burstiness.

Gaps are Gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean 1 / rate always, and
coefficient of variation 1 / sqrt(burstiness), so burstiness 1 is a Poisson process
(exponential gaps, CV 1), below 1 burstier, above 1 more regular. Rate inf sends all at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def arrival_intervals(
    n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """``n`` gaps in seconds; gap i is the wait after request i (the last one is unused)."""
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(n)
    theta = 1.0 / (request_rate * burstiness)
    return np.random.default_rng(seed).gamma(shape=burstiness, scale=theta, size=n)


async def paced(items: Sequence[T], intervals: Sequence[float]) -> AsyncIterator[tuple[int, T]]:
    """Yield (index, item) at the cumulative offsets of ``intervals`` from the first yield.

    Deadlines are absolute, so the sleep overshoot of one gap does not push every later
    request back (drift that would lower the effective rate under a busy event loop).
    """
    start = time.perf_counter()
    offset = 0.0
    for i, item in enumerate(items):
        if i:
            offset += float(intervals[i - 1])
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        yield i, item
