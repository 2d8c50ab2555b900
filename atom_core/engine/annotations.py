"""Trace labels for engine steps, and the profiler settings read from the environment.

The model runner wraps each forward in ``annotate(batch)``: under an active torch profiler
the forward shows up as a ``prefill[bs=.. tok=..]`` or ``decode[bs=.. tok=..]`` range;
otherwise nothing happens (the label is not even built). ATOM_ENABLE_DETAILED_ANNOTATION=1
appends the attention FLOP aggregates used for roofline analysis, summed over the batch's
requests: ``sqsq`` = sum q_len^2, ``sqsk`` = sum q_len*kv_len, ``sk`` = sum kv_len.
ATOM_PROFILER_TIMEOUT is how long the server waits for ``stop_profile`` to write a trace;
ATOM_PROFILER_MAX_STEPS is how many engine steps a server's trace records at most (profiler.py
says why there is a cap).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.profiler import record_function

from atom_core.errors import ConfigError

DEFAULT_PROFILER_TIMEOUT_S = 300.0
DEFAULT_PROFILER_MAX_STEPS = 50


def detailed_annotation() -> bool:
    return os.environ.get("ATOM_ENABLE_DETAILED_ANNOTATION", "0") not in ("", "0", "false", "False")


def profiler_timeout() -> float:
    """Seconds the server waits for the engine to stop the profiler and write its trace."""
    raw = os.environ.get("ATOM_PROFILER_TIMEOUT", "")
    if not raw.strip():
        return DEFAULT_PROFILER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"ATOM_PROFILER_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigError(f"ATOM_PROFILER_TIMEOUT must be positive, got {raw!r}")
    return value


def profiler_max_steps() -> int:
    """Engine steps after which the server's engine loop ends a trace by itself (0: never)."""
    raw = os.environ.get("ATOM_PROFILER_MAX_STEPS", "")
    if not raw.strip():
        return DEFAULT_PROFILER_MAX_STEPS
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"ATOM_PROFILER_MAX_STEPS must be a whole number of steps, got {raw!r}"
        ) from None
    if value < 0:
        raise ConfigError(f"ATOM_PROFILER_MAX_STEPS must be 0 (no cap) or more, got {raw!r}")
    return value


def step_label(batch: Any, detailed: bool | None = None) -> str:
    """``prefill[...]`` if any request in the step computes prompt tokens, else ``decode[...]``.

    ``batch`` is a ScheduledBatch read *before* the scheduler advances it, so each request's
    ``num_computed_tokens`` is where this step's query starts: q_len = scheduled tokens,
    kv_len = computed + scheduled.
    """
    if detailed is None:
        detailed = detailed_annotation()
    q_lens = list(batch.num_scheduled_tokens)
    starts = [s.num_computed_tokens for s in batch.seqs]
    # One new token past the prompt is a decode; a one-token prompt chunk is still prefill.
    prefill = any(q > 1 or start < s.num_prompt_tokens
                  for s, q, start in zip(batch.seqs, q_lens, starts))
    fields = f"bs={len(q_lens)} tok={sum(q_lens)}"
    if detailed:
        kv_lens = [start + q for start, q in zip(starts, q_lens)]
        sqsq = sum(q * q for q in q_lens)
        sqsk = sum(q * k for q, k in zip(q_lens, kv_lens))
        fields += f" sqsq={sqsq} sqsk={sqsk} sk={sum(kv_lens)}"
    return f"{'prefill' if prefill else 'decode'}[{fields}]"


def profiler_active() -> bool:
    return torch.autograd._profiler_enabled()


@contextlib.contextmanager
def annotate(batch: Any) -> Iterator[None]:
    """A record_function range named by ``step_label(batch)`` while a profiler records."""
    if not profiler_active():
        yield
        return
    with record_function(step_label(batch)):
        yield
