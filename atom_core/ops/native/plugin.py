"""Registers the torch reference ops: lowest priority, every device."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl
from atom_core.ops.native.activation import silu_and_mul, silu_and_mul_linear
from atom_core.ops.native.clamped_swiglu_moe import clamped_swiglu_moe
from atom_core.ops.native.linear import linear, rms_norm_linear
from atom_core.ops.native.moe import fused_moe, route
from atom_core.ops.native.norm import fused_add_rms_norm, rms_norm, rms_norm_quant_fp8
from atom_core.ops.native.qk_norm_rope import qk_norm_rope_cache_write
from atom_core.ops.native.rotary import rotary_embedding
from atom_core.ops.native.sampling import argmax
from atom_core.spec_decode.rejection import rejection_sample

NATIVE_OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_embedding": rotary_embedding,
    "fused_moe": fused_moe,
    "moe_route": route,
    "clamped_swiglu_moe": clamped_swiglu_moe,
    "qk_norm_rope_cache_write": qk_norm_rope_cache_write,
    "linear": linear,
    "silu_and_mul_linear": silu_and_mul_linear,
    "rms_norm_linear": rms_norm_linear,
    "rms_norm_quant_fp8": rms_norm_quant_fp8,
    "argmax": argmax,
    "rejection_sample": rejection_sample,
}


@hookimpl
def register_ops(register):
    for name, fn in NATIVE_OPS.items():
        register(name, fn, provider="native", device_kinds=("cpu", "cuda", "hip"), priority=0)
