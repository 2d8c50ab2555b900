"""The fused q/k norm + RoPE + KV-cache write: the Triton kernel against the native reference
(CPU via TRITON_INTERPRET=1, small shapes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton.qk_norm_rope import qk_norm_rope_cache_write as triton_fused  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.native.qk_norm_rope import qk_norm_rope_cache_write as native_fused  # noqa: E402
from atom_core.testing.op_cases import expected_kv_cache, qk_norm_rope_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(dtype, q_heads=4, kv_heads=2, head=32, rot_dim=32):
    return qk_norm_rope_case(dtype, q_heads, kv_heads, head, rot_dim, device=DEVICE)


triton_cases = pytest.mark.parametrize(
    "q_heads,kv_heads,head,rot_dim,is_neox",
    [(4, 2, 32, 32, True), (4, 4, 16, 16, True), (8, 1, 32, 16, True), (4, 2, 32, 32, False),
     (6, 2, 24, 24, True)],  # 6 heads, head 24: non-power-of-two tiles are masked
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@triton_cases
def test_triton_matches_native(dtype, q_heads, kv_heads, head, rot_dim, is_neox):
    q, k, v, qw, kw, pos, cos_sin, cache, slots = case(dtype, q_heads, kv_heads, head, rot_dim)
    ref_cache = cache.clone()
    ref_q, ref_k = native_fused(q, k, v, qw, kw, 1e-6, pos, cos_sin, ref_cache, slots, is_neox)
    got_q, got_k = triton_fused(q, k, v, qw, kw, 1e-6, pos, cos_sin, cache, slots, is_neox)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert rel_err(got_q, ref_q) < tolerance(dtype)
    assert rel_err(got_k, ref_k) < tolerance(dtype)
    # Padding slots (-1) write nothing: the NaN poison survives exactly there.
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    # The cache holds exactly the k the op returned (and v copied bit for bit).
    assert torch.equal(cache.nan_to_num(), expected_kv_cache(cache, got_k, v, slots).nan_to_num())
    assert rel_err(cache.nan_to_num(), ref_cache.nan_to_num()) < tolerance(dtype)


def test_triton_all_padding_and_empty():
    q, k, v, qw, kw, pos, cos_sin, cache, slots = case(torch.float32)
    triton_fused(q, k, v, qw, kw, 1e-6, pos, cos_sin, cache, torch.full_like(slots, -1))
    assert cache.isnan().all()
    got_q, got_k = triton_fused(q[:0], k[:0], v[:0], qw, kw, 1e-6, pos[:0], cos_sin, cache,
                                slots[:0])
    assert got_q.shape == (0, q.shape[1]) and got_k.shape == (0, k.shape[1])
