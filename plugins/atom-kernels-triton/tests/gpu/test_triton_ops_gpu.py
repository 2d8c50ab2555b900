"""Every Triton op against its native reference on the GPU, over dtypes and shapes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from atom_kernels_triton import activation, kv_cache, norm, rotary  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.native import activation as native_act  # noqa: E402
from atom_core.ops.native import norm as native_norm  # noqa: E402
from atom_core.ops.native import rotary as native_rotary  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 1024), (37, 4096), (256, 5120), (4096, 128)])
def test_norms(dtype, rows, hidden):
    x, r = rand(rows, hidden, dtype=dtype), rand(rows, hidden, dtype=dtype)
    w = rand(hidden, dtype=dtype)
    assert rel_err(norm.rms_norm(x, w, 1e-6), native_norm.rms_norm(x, w, 1e-6)) < tolerance(dtype)
    out, summed = norm.fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_sum = native_norm.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, ref_sum)  # the residual stream is bit-identical
    assert rel_err(out, ref_out) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 3072), (200, 12288), (33, 100)])
def test_silu_and_mul(dtype, rows, d):
    x = rand(rows, 2 * d, dtype=dtype)
    assert rel_err(activation.silu_and_mul(x), native_act.silu_and_mul(x)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head,q_heads,k_heads", [(128, 32, 8), (64, 16, 16), (128, 64, 8)])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary(dtype, head, q_heads, k_heads, is_neox):
    tokens = 300
    cache = rand(4096, head)
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    qkv = rand(tokens, (q_heads + 2 * k_heads) * head, dtype=dtype)
    q, k = qkv[:, : q_heads * head], qkv[:, q_heads * head : (q_heads + k_heads) * head]
    got = rotary.rotary_embedding(pos, q, k, head, cache, is_neox)
    ref = native_rotary.rotary_embedding(pos, q, k, head, cache, is_neox)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kvh,d", [(16, 8, 128), (32, 4, 64)])
def test_write_kv_cache(dtype, block_size, kvh, d):
    blocks, tokens = 64, 200
    cache = torch.full((2, blocks, block_size, kvh, d), float("nan"), dtype=dtype, device="cuda")
    ref = cache.clone()
    k, v = rand(tokens, kvh * d, dtype=dtype), rand(tokens, kvh * d, dtype=dtype)
    slots = torch.randperm(blocks * block_size, device="cuda")[:tokens]
    slots[::7] = -1
    kv_cache.write_kv_cache(k, v, cache, slots)
    valid = slots >= 0
    flat = ref.view(2, -1, kvh, d)
    flat[0, slots[valid]] = k[valid].view(-1, kvh, d)
    flat[1, slots[valid]] = v[valid].view(-1, kvh, d)
    assert torch.equal(cache.isnan(), ref.isnan())
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab",
                         [(1, 151936), (32, 151936), (256, 102400), (33, 32000), (4, 7)])
def test_argmax(dtype, rows, vocab):
    from atom_kernels_triton.argmax import argmax

    x = rand(rows, vocab, dtype=dtype)
    x[0, vocab // 3] = x[0, vocab - 1] = 100.0  # a tie across chunks: the first wins
    if rows > 2:
        x[1, vocab // 2] = float("nan")
        x[2] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
