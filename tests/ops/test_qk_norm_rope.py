"""The fused q/k norm + RoPE + KV-cache write: the native reference against the unfused ops
(kernel plugins test theirs against this reference)."""

from __future__ import annotations

import pytest
import torch

from atom_core.ops.native import norm as native_norm
from atom_core.ops.native import rotary as native_rotary
from atom_core.ops.native.qk_norm_rope import qk_norm_rope_cache_write as native_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def case(dtype, q_heads=4, kv_heads=2, head=32, rot_dim=32, tokens=5, blocks=6, block_size=4):
    """Inputs as Qwen3 passes them: q, k, v column slices of one qkv projection output."""
    qkv = rand(tokens, (q_heads + 2 * kv_heads) * head, dtype=dtype)
    q = qkv[:, : q_heads * head]
    k = qkv[:, q_heads * head : (q_heads + kv_heads) * head]
    v = qkv[:, (q_heads + kv_heads) * head :]
    qw, kw = rand(head, dtype=dtype, seed=1), rand(head, dtype=dtype, seed=2)
    cos_sin = rand(64, rot_dim, seed=3)
    pos = torch.tensor([0, 7, 3, 63, 12, 5, 9][:tokens], device=DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 22, -1, 8][:tokens], device=DEVICE)
    cache = torch.full((2, blocks, block_size, kv_heads, head), float("nan"), dtype=dtype,
                       device=DEVICE)
    return q, k, v, qw, kw, pos, cos_sin, cache, slots


def expected_cache(cache, k, v, slots):
    """The cache with the valid tokens' rotated k and v stored; padding slots untouched."""
    kvh, d = cache.shape[-2:]
    ref = cache.clone()
    flat = ref.view(2, -1, kvh, d)
    valid = slots >= 0
    flat[0, slots[valid]] = k[valid].reshape(-1, kvh, d).to(cache.dtype)
    flat[1, slots[valid]] = v[valid].reshape(-1, kvh, d).to(cache.dtype)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_matches_unfused_path(dtype):
    q, k, v, qw, kw, pos, cos_sin, cache, slots = case(dtype)
    got_q, got_k = native_fused(q, k, v, qw, kw, 1e-6, pos, cos_sin, cache, slots)
    ref_q = native_norm.rms_norm(q.reshape(-1, 32), qw, 1e-6).view(q.shape)
    ref_k = native_norm.rms_norm(k.reshape(-1, 32), kw, 1e-6).view(k.shape)
    ref_q, ref_k = native_rotary.rotary_embedding(pos, ref_q, ref_k, 32, cos_sin, True)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    ref = expected_cache(cache.clone().fill_(float("nan")), ref_k, v, slots)
    assert torch.equal(cache.isnan(), ref.isnan())
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())
