"""Registers the Triton ops and attention backends for CUDA/ROCm, or declines with the reason.

Imports no triton where triton is missing or torch sees no GPU, so CPU start-up never
depends on it; ``atom plugins`` shows why it declined.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from atom_core.hookspecs import hookimpl

PROVIDER = "triton"
PRIORITY = 10  # above the core's torch reference ops (0), below aiter on ROCm (20)
DEVICE_KINDS = ("cuda", "hip")


def triton_importable() -> bool:
    """True when the triton package is installed."""
    return importlib.util.find_spec("triton") is not None


def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot serve this process, or None when they can."""
    if not triton_importable():
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA/ROCm device"
    return None


def triton_ops() -> dict[str, Any]:
    """Op name -> Triton implementation (imports the kernels)."""
    from atom_kernels_triton.activation import silu_and_mul
    from atom_kernels_triton.argmax import argmax
    from atom_kernels_triton.clamped_swiglu_moe import clamped_swiglu_moe
    from atom_kernels_triton.fp8_norm_quant import rms_norm_quant_fp8
    from atom_kernels_triton.fused_moe import fused_moe
    from atom_kernels_triton.gemv import linear, rms_norm_linear, silu_and_mul_linear
    from atom_kernels_triton.moe_topk import route
    from atom_kernels_triton.norm import fused_add_rms_norm, rms_norm
    from atom_kernels_triton.qk_norm_rope import qk_norm_rope_cache_write
    from atom_kernels_triton.rejection import rejection_sample
    from atom_kernels_triton.rotary import rotary_embedding

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "silu_and_mul": silu_and_mul,
        "rotary_embedding": rotary_embedding,
        "qk_norm_rope_cache_write": qk_norm_rope_cache_write,
        "fused_moe": fused_moe,
        "clamped_swiglu_moe": clamped_swiglu_moe,
        "moe_route": route,
        "linear": linear,
        "silu_and_mul_linear": silu_and_mul_linear,
        "rms_norm_linear": rms_norm_linear,
        "rms_norm_quant_fp8": rms_norm_quant_fp8,
        "argmax": argmax,
        "rejection_sample": rejection_sample,
    }


def attention_backends() -> dict[str, tuple[type, str]]:
    """Backend name -> (class, attention kind)."""
    from atom_kernels_triton.attention_backend import TritonAttentionBackend
    from atom_kernels_triton.mla_backend import TritonMLABackend

    return {"triton": (TritonAttentionBackend, "mha"), "triton_mla": (TritonMLABackend, "mla")}


@hookimpl
def register_ops(register):
    reason = unavailable_reason()
    if reason is not None:
        register.decline(reason)
        return
    for name, fn in triton_ops().items():
        register(name, fn, provider=PROVIDER, device_kinds=DEVICE_KINDS, priority=PRIORITY)


@hookimpl
def register_attention_backends(register):
    reason = unavailable_reason()
    if reason is not None:
        register.decline(reason)
        return
    for name, (cls, kind) in attention_backends().items():
        register(name, cls, device_kinds=DEVICE_KINDS, kind=kind, priority=PRIORITY)
