"""The fused q/k norm + RoPE + KV-cache write: the native reference against the unfused ops
(kernel plugins test theirs against this reference)."""

from __future__ import annotations

import pytest
import torch

from atom_core.ops.native import norm as native_norm
from atom_core.ops.native import rotary as native_rotary
from atom_core.ops.native.qk_norm_rope import qk_norm_rope_cache_write as native_fused
from atom_core.testing.op_cases import expected_kv_cache, qk_norm_rope_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(dtype, **shape):
    return qk_norm_rope_case(dtype, device=DEVICE, **shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_matches_unfused_path(dtype):
    q, k, v, qw, kw, pos, cos_sin, cache, slots = case(dtype)
    got_q, got_k = native_fused(q, k, v, qw, kw, 1e-6, pos, cos_sin, cache, slots)
    ref_q = native_norm.rms_norm(q.reshape(-1, 32), qw, 1e-6).view(q.shape)
    ref_k = native_norm.rms_norm(k.reshape(-1, 32), kw, 1e-6).view(k.shape)
    ref_q, ref_k = native_rotary.rotary_embedding(pos, ref_q, ref_k, 32, cos_sin, True)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    ref = expected_kv_cache(cache.clone().fill_(float("nan")), ref_k, v, slots)
    assert torch.equal(cache.isnan(), ref.isnan())
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())


def test_fp8_cache_stores_k_and_v_over_their_scales():
    """An fp8 cache gets the rotated k and v divided by k_scale / v_scale, saturated: the
    bytes ``write_kv_cache`` stores with the same scales."""
    from atom_core.ops.native.kv_cache import FP8_KV_DTYPE, write_kv_cache

    q, k, v, qw, kw, pos, cos_sin, cache, slots = case(torch.float32)
    v.mul_(600)  # past 448 * v_scale in places
    cache = cache.to(FP8_KV_DTYPE)
    ref = cache.clone()
    got_q, got_k = native_fused(q, k, v, qw, kw, 1e-6, pos, cos_sin, cache, slots, True,
                                0.37, 2.9)
    write_kv_cache(got_k.view(len(slots), 2, 32), v.view(len(slots), 2, 32), ref, slots,
                   0.37, 2.9)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    flat = cache.view(2, -1, 2, 32).float()
    valid = slots >= 0
    stored_v = (v[valid].view(-1, 2, 32) * torch.tensor(1 / 2.9)).clamp(-448, 448)
    stored_v = stored_v.to(FP8_KV_DTYPE).float()
    assert torch.equal(flat[1, slots[valid]], stored_v)
    assert bool((flat[1, slots[valid]].abs() == 448).any())
