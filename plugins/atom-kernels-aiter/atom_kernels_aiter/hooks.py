"""Registers aiter's fused ops for ROCm devices, or declines with the reason."""

from __future__ import annotations

import importlib.util

import torch

from atom_core.hookspecs import hookimpl

PRIORITY = 20  # above native (0) and triton (10): aiter is the tuned path on ROCm


def unavailable_reason() -> str | None:
    """Why aiter cannot serve this machine, or None when it can."""
    if not getattr(torch.version, "hip", None):
        return "no ROCm: this torch build has no HIP support"
    if importlib.util.find_spec("aiter") is None:
        return "the aiter package (amd-aiter) is not installed"
    if not torch.cuda.is_available():
        return "ROCm torch found but no GPU is visible"
    return None


def _ops() -> dict:
    import aiter

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return aiter.rms_norm(x, weight, eps)

    def fused_add_rms_norm(x, residual, weight, eps):
        out = torch.empty_like(x)
        residual_out = torch.empty_like(x)
        aiter.rmsnorm2d_fwd_with_add(out, x, residual, residual_out, weight, eps)
        return out, residual_out

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        aiter.silu_and_mul(out, x)
        return out

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "silu_and_mul": silu_and_mul,
    }


@hookimpl
def register_ops(register):
    reason = unavailable_reason()
    if reason is not None:
        register.decline(reason)
        return
    for name, fn in _ops().items():
        register(name, fn, provider="aiter", device_kinds=("hip",), priority=PRIORITY)
