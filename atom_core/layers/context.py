"""Process-wide context the layers read: the device a model is built for, and the
attention metadata of the forward pass in flight (set by the model runner)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from atom_core.layers.attention.metadata import AttentionMetadata


@dataclass
class BuildContext:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str | None = None  # forced backend name, else the registry's choice
    # The linears' and experts' weights left on the meta device, for the loader to allocate
    # in the format they are served in (``quant.online.allocate_weights``): an FP8 model
    # never holds its linears in the model dtype.
    defer_weights: bool = False


_build: BuildContext | None = None
_forward: AttentionMetadata | None = None


@contextmanager
def build_context(ctx: BuildContext) -> Iterator[BuildContext]:
    """Layers constructed inside resolve their ops and backends for ``ctx.device``."""
    global _build
    prev, _build = _build, ctx
    try:
        yield ctx
    finally:
        _build = prev


def get_build_context() -> BuildContext:
    if _build is not None:
        return _build
    return BuildContext(torch.get_default_device(), torch.get_default_dtype())


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _forward
    prev, _forward = _forward, meta
    try:
        yield meta
    finally:
        _forward = prev


def get_forward_context() -> AttentionMetadata:
    if _forward is None:
        raise RuntimeError("attention called outside a forward_context")
    return _forward
