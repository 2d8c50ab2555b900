"""Programmatic dependent launch (PDL): a decode kernel starts while the one before it drains.

At batch 1 a decode step is a chain of ~10 short kernels a layer, and each would otherwise
begin only after the previous one has finished and its launch has gone through: a few
microseconds of an idle GPU per kernel. With PDL (Hopper and later) a kernel is launched
early; its programs run whatever does not depend on the previous kernel (a GEMV loads its
first weight tile - a program's whole slice where gemv_config's BLOCK_K spans it - which
nothing in a decode step writes; decode attention its metadata and
first K/V tile) and then wait in ``pdl_wait`` until the previous kernel has completed and
its writes are visible.

The rule every kernel launched with PDL keeps: before ``pdl_wait`` it reads only what no
kernel of the step writes (weights, the host-written batch metadata, the KV cache rows of
earlier steps), writes nothing, and every program reaches ``pdl_wait``. Then kernel k+1
cannot finish before kernel k, so waiting on the previous kernel orders it after all of
them. One kernel orders itself otherwise and keeps that consequence: ``fused_moe``'s
overlapped down kernel waits on per-block counts of the gate/up kernel's programs, not on
the whole kernel (its docstring says why that holds). A value read again after the wait
comes from L2 (``.cg``): L1 is not kept coherent with other SMs' writes. Kernels of other
libraries (cuBLAS, torch) are launched without PDL and start after the one before them has
finished, as always.

``ATOM_PDL=0`` turns it off (A/B measurements). It is captured into CUDA graphs as
programmatic edges.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL stays off, and the PDL=False branch is never compiled
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait until the previous kernel's writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def pdl_launch_next(PDL: tl.constexpr):
    """Let the next kernel launch, without waiting for the previous one: for a kernel
    that orders itself after what it reads by other means (``fused_moe``'s overlapped down
    kernel waits on per-block counters)."""
    if PDL:
        gdc_launch_dependents()


_OFF: dict[str, Any] = {"PDL": False}
_ON: dict[str, Any] = {"PDL": True, "launch_pdl": True}


@functools.cache
def _options(index: int) -> dict[str, Any]:
    if os.environ.get("ATOM_PDL", "1") == "0" or gdc_wait is None or torch.version.hip is not None:
        return _OFF
    return _ON if torch.cuda.get_device_capability(index)[0] >= 9 else _OFF


def pdl_options(device: torch.device) -> dict[str, Any]:
    """Keyword arguments for a kernel launch: the ``PDL`` constexpr and, when on, ``launch_pdl``.
    Decided once per device (``ATOM_PDL`` is read then)."""
    if device.type != "cuda":
        return _OFF
    return _options(device.index if device.index is not None else torch.cuda.current_device())
