"""Qwen3's attention input in one op: per-head RMSNorm of q and k, RoPE, and the paged
KV-cache write of k and v. The reference composes the native ops in the order the model
runs them unfused, so it is bit-identical to that path."""

from __future__ import annotations

import torch

from atom_core.ops.native.kv_cache import write_kv_cache
from atom_core.ops.native.norm import rms_norm
from atom_core.ops.native.rotary import rotary_embedding


def qk_norm_rope_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, q_heads*D], k and v [T, kv_heads*D] (rows may be strided); weights [D].

    Returns new (q, k), normed and rotated, in the inputs' dtype; k (rotated) and v are
    stored in ``kv_cache`` ([2, blocks, block_size, kv_heads, D]) at ``slot_mapping``,
    where slot -1 marks a padding token that is not stored; an fp8 cache stores them
    divided by ``k_scale`` / ``v_scale`` (ops/native/kv_cache.py). ``cos_sin_cache`` is the
    [max_position, rot_dim] layout of ``atom_core.layers.rotary`` (rot_dim <= D).
    """
    head_dim = q_weight.shape[0]
    num_tokens = q.shape[0]
    q = rms_norm(q.reshape(-1, head_dim), q_weight, eps).view(q.shape)
    k = rms_norm(k.reshape(-1, head_dim), k_weight, eps).view(k.shape)
    q, k = rotary_embedding(positions, q, k, head_dim, cos_sin_cache, is_neox)
    write_kv_cache(
        k.reshape(num_tokens, -1, head_dim), v.reshape(num_tokens, -1, head_dim), kv_cache,
        slot_mapping, k_scale, v_scale,
    )
    return q, k
