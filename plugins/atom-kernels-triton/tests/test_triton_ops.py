"""Triton ops vs their native references, on CPU through TRITON_INTERPRET=1 (small shapes)
or on a GPU when there is one. Skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import activation, kv_cache, norm, rotary  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.native import activation as native_act  # noqa: E402
from atom_core.ops.native import norm as native_norm  # noqa: E402
from atom_core.ops.native import rotary as native_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm(dtype, hidden):
    x, w = rand(7, hidden, dtype=dtype), rand(hidden, dtype=dtype, seed=1)
    ref = native_norm.rms_norm(x, w, 1e-6)
    assert rel_err(norm.rms_norm(x, w, 1e-6), ref) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(dtype):
    # Qwen3's per-head norm input: a column slice of the qkv output.
    qkv = rand(5, 3 * 64, dtype=dtype)
    x, w = qkv[:, :64], rand(64, dtype=dtype, seed=1)
    assert rel_err(norm.rms_norm(x, w, 1e-6), native_norm.rms_norm(x, w, 1e-6)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype):
    x, r = rand(6, 96, dtype=dtype), rand(6, 96, dtype=dtype, seed=1)
    w = rand(96, dtype=dtype, seed=2)
    out, summed = norm.fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_sum = native_norm.fused_add_rms_norm(x, r, w, 1e-5)
    # The interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest (tests/gpu
    # checks bit equality there), so allow one bf16 ulp here.
    assert rel_err(summed, ref_sum) < tolerance(dtype)
    assert rel_err(out, ref_out) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = rand(5, 2 * 80, dtype=dtype)
    assert rel_err(activation.silu_and_mul(x), native_act.silu_and_mul(x)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary(dtype, is_neox, rot_dim):
    head, q_heads, k_heads, tokens = 32, 4, 2, 5
    cache = rand(64, rot_dim, seed=3)
    pos = torch.tensor([0, 7, 3, 63, 12], device=DEVICE)
    q = rand(tokens, q_heads * head, dtype=dtype)
    k = rand(tokens, k_heads * head, dtype=dtype, seed=1)
    got = rotary.rotary_embedding(pos, q, k, head, cache, is_neox)
    ref = native_rotary.rotary_embedding(pos, q, k, head, cache, is_neox)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < tolerance(dtype)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_reads_strided_heads_in_place(is_neox, monkeypatch):
    # DeepSeek's q_pe: the last 16 of each 48-wide head of q, as [T, heads, 16] with a head
    # stride of 48, and its k_pe: the tail of each latent row. Neither is copied first.
    tokens, heads, nope, rope = 5, 4, 32, 16
    cache = rand(64, rope, seed=3)
    pos = torch.tensor([0, 7, 3, 63, 12], device=DEVICE)
    q_pe = rand(tokens, heads, nope + rope)[..., nope:]
    k_pe = rand(tokens, 24 + rope, seed=1)[:, 24:]
    read = []
    real = rotary._rotary_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                read.extend((args[1].data_ptr(), args[4].data_ptr()))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(rotary, "_rotary_kernel", Spy())
    got = rotary.rotary_embedding(pos, q_pe, k_pe, rope, cache, is_neox)
    assert read == [q_pe.data_ptr(), k_pe.data_ptr()]
    assert got[0].shape == q_pe.shape and got[1].shape == k_pe.shape
    ref = native_rotary.rotary_embedding(pos, q_pe, k_pe, rope, cache, is_neox)
    flat = rotary.rotary_embedding(pos, q_pe.reshape(tokens, -1), k_pe, rope, cache, is_neox)
    for a, b, c in zip(got, ref, flat):
        assert rel_err(a, b) < tolerance(torch.float32)
        assert torch.equal(a.reshape(c.shape), c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(dtype):
    blocks, bs, kvh, d = 6, 4, 2, 16
    cache = torch.full((2, blocks, bs, kvh, d), float("nan"), dtype=dtype, device=DEVICE)
    ref = cache.clone()
    k, v = rand(5, kvh * d, dtype=dtype), rand(5, kvh * d, dtype=dtype, seed=1)
    slots = torch.tensor([3, 17, -1, 0, 22], device=DEVICE)
    kv_cache.write_kv_cache(k, v, cache, slots)
    valid = slots >= 0
    flat = ref.view(2, -1, kvh, d)
    flat[0, slots[valid]] = k[valid].view(-1, kvh, d)
    flat[1, slots[valid]] = v[valid].view(-1, kvh, d)
    assert torch.equal(cache.isnan(), ref.isnan())
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())
