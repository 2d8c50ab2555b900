"""Forced acceptance: resolving the two spellings, the schedule, and the sampler's statistics."""

from __future__ import annotations

import pytest
import torch

from atom_core.spec_decode.forced import (
    marginal_acceptance,
    resolve_acceptance_length,
    sample_forced_accepts,
)


def test_example_schedule() -> None:
    assert marginal_acceptance(3.78, 7) == pytest.approx([1, 1, 0.78, 0, 0, 0, 0])


def test_length_one_accepts_nothing() -> None:
    assert marginal_acceptance(1.0, 5) == [0.0] * 5
    assert sample_forced_accepts(1.0, 5, 100).tolist() == [0] * 100


def test_length_k_plus_one_accepts_everything() -> None:
    assert marginal_acceptance(6.0, 5) == [1.0] * 5
    assert sample_forced_accepts(6.0, 5, 100).tolist() == [5] * 100


@pytest.mark.parametrize("k, rate", [(7, 0.0), (7, 0.4), (3, 0.5), (5, 1.0), (1, 0.3)])
def test_rate_spelling_equals_length_spelling(k: int, rate: float) -> None:
    length = resolve_acceptance_length(k, length=1 + rate * k)
    assert resolve_acceptance_length(k, rate=rate) == pytest.approx(length)
    assert 1.0 <= resolve_acceptance_length(k, rate=rate) <= k + 1


def test_resolve_neither_is_none() -> None:
    assert resolve_acceptance_length(4) is None


@pytest.mark.parametrize(
    "k, length, rate, message",
    [
        (4, 2.0, 0.5, "mutually exclusive"),
        (4, 0.5, None, r"\[1, k\+1\] = \[1, 5\].*0\.5"),
        (4, 5.01, None, r"\[1, 5\]"),
        (4, float("nan"), None, "nan"),
        (4, None, -0.1, r"\[0, 1\].*-0\.1"),
        (4, None, 1.5, r"\[0, 1\]"),
        (0, 1.0, None, "k=0"),
        (0, None, 0.5, "k=0"),
    ],
)
def test_resolve_errors(k: int, length: float | None, rate: float | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_acceptance_length(k, length=length, rate=rate)


@pytest.mark.parametrize("length, k", [(0.9, 3), (4.5, 3), (2.0, 0)])
def test_schedule_and_sampler_reject_bad_length(length: float, k: int) -> None:
    with pytest.raises(ValueError):
        marginal_acceptance(length, k)
    with pytest.raises(ValueError):
        sample_forced_accepts(length, k, 4)


@pytest.mark.parametrize("length, k", [(3.78, 7), (1.3, 4), (2.5, 3), (4.0, 5), (5.9, 5)])
def test_realized_statistics_match_schedule(length: float, k: int) -> None:
    steps = 2000
    gen = torch.Generator().manual_seed(1234)
    accepted = sample_forced_accepts(length, k, steps, generator=gen)
    assert accepted.dtype == torch.int64 and accepted.shape == (steps,)
    assert int(accepted.min()) >= 0 and int(accepted.max()) <= k
    # Mean acceptance length counts the target's own token.
    assert abs(float(accepted.double().mean()) + 1 - length) < 0.05
    positions = torch.arange(k)
    frequency = (accepted[:, None] > positions[None, :]).double().mean(dim=0)
    for got, want in zip(frequency.tolist(), marginal_acceptance(length, k)):
        assert abs(got - want) < 0.03
    # Minimum variance: only two adjacent counts ever occur.
    assert set(accepted.tolist()) <= {int(length - 1), int(length - 1) + 1}


def test_seeded_generator_reproduces() -> None:
    first = sample_forced_accepts(3.78, 7, 500, generator=torch.Generator().manual_seed(7))
    second = sample_forced_accepts(3.78, 7, 500, generator=torch.Generator().manual_seed(7))
    other = sample_forced_accepts(3.78, 7, 500, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)
