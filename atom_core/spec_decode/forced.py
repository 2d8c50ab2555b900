"""Forced acceptance: a benchmark-only knob that fixes the mean acceptance length.

``--spec-decode-acceptance-length L`` (L in [1, k+1], counting the target's own guaranteed
token) or ``--spec-decode-acceptance-rate r`` (r in [0, 1], L = 1 + r*k) replaces the
draft/target agreement test, so a benchmark can measure throughput at a chosen acceptance
without a draft that really achieves it. The schedule has minimum variance: the budget L-1
is spent on the earliest draft positions, e.g. L = 3.78 over k = 7 accepts 2 drafts always,
a 3rd with probability 0.78 and never the rest.
"""

from __future__ import annotations

import math

import torch


def resolve_acceptance_length(
    k: int, length: float | None = None, rate: float | None = None
) -> float | None:
    """The forced mean acceptance length L from either spelling, or None when neither is set.

    Raises ValueError when both are set, a value is out of range (or NaN), or k < 1.
    """
    if length is not None and rate is not None:
        raise ValueError(
            "--spec-decode-acceptance-length and --spec-decode-acceptance-rate are mutually "
            "exclusive: set at most one"
        )
    if length is None and rate is None:
        return None
    if k < 1:
        raise ValueError(f"forced acceptance needs at least 1 speculative token, got k={k}")
    if rate is not None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"--spec-decode-acceptance-rate must be in [0, 1], got {rate}")
        # Clamped so that rate 1 gives exactly k+1 despite rounding.
        return min(1.0 + rate * k, float(k + 1))
    if not 1.0 <= length <= k + 1:
        raise ValueError(
            f"--spec-decode-acceptance-length must be in [1, k+1] = [1, {k + 1}] "
            f"for k={k}, got {length}"
        )
    return float(length)


def _check(length: float, k: int) -> None:
    if k < 1:
        raise ValueError(f"forced acceptance needs at least 1 speculative token, got k={k}")
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"acceptance length must be in [1, {k + 1}] for k={k}, got {length}")


def marginal_acceptance(length: float, k: int) -> list[float]:
    """P(draft position j is accepted), j = 1..k: [1, 1, 0.78, 0, 0, 0, 0] for L=3.78, k=7."""
    _check(length, k)
    budget = length - 1.0
    return [min(1.0, max(0.0, budget - j)) for j in range(k)]


def sample_forced_accepts(
    length: float,
    k: int,
    num_seqs: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Accepted drafts per sequence (int64, shape [num_seqs], values 0..k) under the schedule.

    One uniform per sequence suffices because the schedule is a prefix: floor(L-1) drafts
    always, one more with probability frac(L-1). ``generator`` must live on ``device``.
    """
    _check(length, k)
    budget = length - 1.0
    whole = math.floor(budget)
    frac = budget - whole
    u = torch.rand(num_seqs, generator=generator, device=device)
    accepted = (u < frac).to(torch.int64) + whole
    return accepted.clamp_(max=k)
