"""Registers the Triton ops for CUDA/ROCm at priority 10 (above native's 0).

Registers nothing - and imports no triton - where triton is missing or torch sees no GPU,
so CPU start-up never depends on it. The reason is logged once at INFO (not recorded as
the core declining: the core still registers its native ops).
"""

from __future__ import annotations

import logging

import torch

from atom_core.hookspecs import hookimpl
from atom_core.ops.triton import triton_importable

logger = logging.getLogger(__name__)

TRITON_PRIORITY = 10
TRITON_DEVICE_KINDS = ("cuda", "hip")


def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot serve this process, or None when they can."""
    if not triton_importable():
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA/ROCm device"
    return None


_logged = False


def usable() -> bool:
    global _logged
    reason = unavailable_reason()
    if reason is not None and not _logged:
        _logged = True
        logger.info("Triton kernels not registered: %s", reason)
    return reason is None


def triton_ops() -> dict:
    from atom_core.ops.triton.activation import silu_and_mul
    from atom_core.ops.triton.argmax import argmax
    from atom_core.ops.triton.fused_moe import fused_moe
    from atom_core.ops.triton.gemv import linear, rms_norm_linear, silu_and_mul_linear
    from atom_core.ops.triton.moe_topk import route
    from atom_core.ops.triton.norm import fused_add_rms_norm, rms_norm
    from atom_core.ops.triton.qk_norm_rope import qk_norm_rope_cache_write
    from atom_core.ops.triton.rotary import rotary_embedding

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "silu_and_mul": silu_and_mul,
        "rotary_embedding": rotary_embedding,
        "qk_norm_rope_cache_write": qk_norm_rope_cache_write,
        "fused_moe": fused_moe,
        "moe_route": route,
        "linear": linear,
        "silu_and_mul_linear": silu_and_mul_linear,
        "rms_norm_linear": rms_norm_linear,
        "argmax": argmax,
    }


@hookimpl
def register_ops(register):
    if not usable():
        return
    for name, fn in triton_ops().items():
        register(name, fn, provider="triton", device_kinds=TRITON_DEVICE_KINDS, priority=TRITON_PRIORITY)
