"""The arrival process: gamma gaps with mean 1/rate and CV 1/sqrt(burstiness)."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from atom_core.benchmarks.arrivals import arrival_intervals, paced

N = 50_000  # standard error of the mean and of the CV: ~0.45% of their value at burstiness 1


@pytest.mark.parametrize("rate", [4.0, 100.0])
def test_burstiness_one_is_poisson(rate):
    gaps = arrival_intervals(N, rate, 1.0, seed=1)
    mean, cv = gaps.mean(), gaps.std() / gaps.mean()
    # 3% is > 6 standard errors: a wrong scale or shape fails, sampling noise does not.
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert cv == pytest.approx(1.0, rel=0.03)
    # Exponential gaps are memoryless: P(gap > 2/rate) = e^-2.
    assert (gaps > 2 / rate).mean() == pytest.approx(math.exp(-2), abs=0.01)
    # Counts in windows of 1/rate seconds are Poisson(1): variance equals mean.
    counts = np.bincount(np.floor(np.cumsum(gaps) * rate).astype(int))
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_sets_cv_not_rate(burstiness):
    gaps = arrival_intervals(N, 10.0, burstiness, seed=2)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_all_at_once_and_seed_repeats():
    assert not arrival_intervals(10, math.inf).any()
    assert np.array_equal(arrival_intervals(5, 3.0, seed=7), arrival_intervals(5, 3.0, seed=7))
    with pytest.raises(ValueError):
        arrival_intervals(5, 3.0, burstiness=0)


def test_paced_keeps_absolute_deadlines():
    gaps = [0.02] * 10

    async def run():
        start = time.perf_counter()
        return [(i, time.perf_counter() - start) async for i, _ in paced(list(range(11)), gaps)]

    got = asyncio.run(run())
    assert [i for i, _ in got] == list(range(11))
    # The last yield is due at 0.2 s; per-gap sleep overshoot must not accumulate.
    assert 0.2 <= got[-1][1] < 0.2 + 0.05
