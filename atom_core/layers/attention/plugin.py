"""Registers the core's attention backends: native (MHA) and native_mla, on every device at
priority 0 (kernel plugins register faster ones above them)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl
from atom_core.layers.attention.mla_native import NativeMLABackend
from atom_core.layers.attention.native import NativeAttentionBackend


@hookimpl
def register_attention_backends(register):
    register(
        "native", NativeAttentionBackend, device_kinds=("cpu", "cuda", "hip"), kind="mha",
        priority=0,
    )
    register(
        "native_mla", NativeMLABackend, device_kinds=("cpu", "cuda", "hip"), kind="mla",
        priority=0,
    )
