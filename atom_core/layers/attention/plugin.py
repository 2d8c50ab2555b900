"""Registers the attention backends: native (MHA) and native_mla (every device, priority 0)
and, where triton and a GPU are present, triton (MHA) and triton_mla (cuda/hip, priority 10)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl
from atom_core.layers.attention.mla_native import NativeMLABackend
from atom_core.layers.attention.native import NativeAttentionBackend


@hookimpl
def register_attention_backends(register):
    register(
        "native", NativeAttentionBackend, device_kinds=("cpu", "cuda", "hip"), kind="mha", priority=0
    )
    register(
        "native_mla", NativeMLABackend, device_kinds=("cpu", "cuda", "hip"), kind="mla", priority=0
    )
    from atom_core.ops.triton.plugin import TRITON_DEVICE_KINDS, TRITON_PRIORITY, usable

    if usable():
        from atom_core.layers.attention.mla_triton import TritonMLABackend
        from atom_core.layers.attention.triton_backend import TritonAttentionBackend

        register(
            "triton", TritonAttentionBackend, device_kinds=TRITON_DEVICE_KINDS, kind="mha",
            priority=TRITON_PRIORITY,
        )
        register(
            "triton_mla", TritonMLABackend, device_kinds=TRITON_DEVICE_KINDS, kind="mla",
            priority=TRITON_PRIORITY,
        )
