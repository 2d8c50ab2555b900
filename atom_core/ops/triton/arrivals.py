"""Arrival counters: the last program of a group to finish does the group's final step.

A kernel split into programs that each write a partial result (split-K GEMV, split-KV
decode attention) needs the partials combined. A second kernel costs its launch and the
gap before it; instead each program, after storing its partial, adds 1 to its group's
counter, and the one that sees the count reach the group's size combines the partials in
the same launch and resets the counter to 0. The group members' partial stores must be
ordered before the count: ``tl.debug_barrier()`` (all threads' stores before the one
thread's atomic) and then ``tl.atomic_add(..., sem="acq_rel", scope="gpu")``, whose release
publishes them and whose acquire makes them visible to the last program; it reads them
with ``cache_modifier=".cg"`` (from L2, which is coherent; L1 is not).

Counters live in one int32 buffer per (device, capacity). Each launch leaves every counter
it used back at 0, so a buffer is zeroed once at allocation and never again (a memset would
be one more graph node). Kernels of a step run one after another on one stream, and with
PDL none touches a counter before its ``pdl_wait``, so no two launches count in a buffer at
once. Buffers are never freed, because a captured CUDA graph keeps the address it was
captured with and replays against it.
"""

from __future__ import annotations

import torch
import triton

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``needed`` counters on ``device``, shared by every
    kernel that asks for the same capacity. Allocate outside CUDA-graph capture (a warm-up
    run): a ``zeros`` inside it would be captured, not run."""
    capacity = max(64, triton.next_power_of_2(needed))  # few distinct buffers
    buf = _COUNTERS.get((device, capacity))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrival counters must be allocated by a warm-up run outside graph capture")
        buf = _COUNTERS[(device, capacity)] = torch.zeros(capacity, dtype=torch.int32, device=device)
    return buf


def all_counters() -> list[torch.Tensor]:
    """Every buffer allocated so far (tests check that each launch left them at 0)."""
    return list(_COUNTERS.values())
