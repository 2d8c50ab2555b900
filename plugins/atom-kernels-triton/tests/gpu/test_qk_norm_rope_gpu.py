"""The fused q/k norm + RoPE + KV-cache write on the GPU: against the native reference and
the unfused Triton ops over dtypes, head dims 64/128, GQA ratios 1/4/8 and block sizes
16/32; through the Triton attention backend (cache_written=True); and replayed from a
captured CUDA graph. And the same input fused into decode attention (``new_tokens``):
bitwise the two-launch path over the sweep, long contexts and batch 256."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton import kv_cache, norm, rotary  # noqa: E402
from atom_kernels_triton.attention_backend import TritonAttentionBackend  # noqa: E402
from atom_kernels_triton.decode_attention import num_kv_splits  # noqa: E402
from atom_kernels_triton.qk_norm_rope import qk_norm_rope_cache_write as triton_fused  # noqa: E402
from test_decode_attention_fused_input import check_fused  # noqa: E402
from triton_reference import paged_batch, rel_err, tolerance  # noqa: E402

from atom_core.ops.native.qk_norm_rope import qk_norm_rope_cache_write as native_fused  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-6


def qkv_inputs(tokens, heads, kv_heads, head_dim, dtype, max_pos=4096, rot_dim=None, seed=0):
    """q, k, v as column slices of one qkv output (as Qwen3 passes them), norm weights
    near 1 (as trained ones are), positions and a real RoPE cos/sin cache."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda",
                      generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    qw = (1 + 0.1 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype)
    rot_dim = rot_dim or head_dim
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot_dim, 2, device="cuda").float() / rot_dim))
    freqs = torch.arange(max_pos, device="cuda").float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos = torch.randint(0, max_pos, (tokens,), device="cuda", generator=g)
    return q, k, v, qw, kw, pos, cos_sin


def slots_for(tokens, num_blocks, block_size, pad_every=7, seed=0):
    """Distinct random slots, every pad_every-th token a padding token (-1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=g)[:tokens]
    slots[::pad_every] = -1
    return slots


def check_cache(cache, ref_cache, k_out, v, slots, dtype):
    kvh, d = cache.shape[-2:]
    assert torch.equal(cache.isnan(), ref_cache.isnan())  # padding slots untouched
    valid = slots >= 0
    flat = cache.view(2, -1, kvh, d)
    # The cache holds exactly the k the op returned, and v bit for bit.
    assert torch.equal(flat[0, slots[valid]], k_out[valid].view(-1, kvh, d))
    assert torch.equal(flat[1, slots[valid]], v[valid].reshape(-1, kvh, d))
    assert rel_err(cache.nan_to_num(), ref_cache.nan_to_num()) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_matches_native_and_unfused(dtype, head_dim, group, block_size, tokens):
    kv_heads = 8 if group < 8 else 4
    heads = kv_heads * group
    q, k, v, qw, kw, pos, cos_sin = qkv_inputs(tokens, heads, kv_heads, head_dim, dtype)
    num_blocks = tokens // block_size + 4
    slots = (slots_for(tokens, num_blocks, block_size) if tokens > 1
             else torch.tensor([5], device="cuda"))
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype,
                       device="cuda")
    ref_cache = cache.clone()
    ref_q, ref_k = native_fused(q, k, v, qw, kw, EPS, pos, cos_sin, ref_cache, slots)
    got_q, got_k = triton_fused(q, k, v, qw, kw, EPS, pos, cos_sin, cache, slots)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == dtype
    assert rel_err(got_q, ref_q) < tolerance(dtype)
    assert rel_err(got_k, ref_k) < tolerance(dtype)
    check_cache(cache, ref_cache, got_k, v, slots, dtype)
    # The unfused Triton path the model ran before: rms_norm, rotary, write_kv_cache.
    uq = norm.rms_norm(q.reshape(-1, head_dim), qw, EPS).view(q.shape)
    uk = norm.rms_norm(k.reshape(-1, head_dim), kw, EPS).view(k.shape)
    uq, uk = rotary.rotary_embedding(pos, uq, uk, head_dim, cos_sin, True)
    assert rel_err(got_q, uq) < tolerance(dtype)
    assert rel_err(got_k, uk) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim,is_neox", [(64, False), (32, True)])
def test_partial_rotary_and_gptj(dtype, rot_dim, is_neox):
    q, k, v, qw, kw, pos, cos_sin = qkv_inputs(300, 16, 4, 128, dtype, rot_dim=rot_dim)
    slots = slots_for(300, 32, 16)
    cache = torch.full((2, 32, 16, 4, 128), float("nan"), dtype=dtype, device="cuda")
    ref_cache = cache.clone()
    ref = native_fused(q, k, v, qw, kw, EPS, pos, cos_sin, ref_cache, slots, is_neox)
    got = triton_fused(q, k, v, qw, kw, EPS, pos, cos_sin, cache, slots, is_neox)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < tolerance(dtype)
    check_cache(cache, ref_cache, got[1], v, slots, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(128, 8), (64, 4), (128, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_through_triton_backend(dtype, head_dim, group, block_size):
    """A mixed batch (decodes, a fresh prefill, a chunk over a cached prefix): the fused
    write + forward(cache_written=True) equals the backend's own write + forward."""
    kv_heads = 4
    heads = kv_heads * group
    query_lens, context_lens = [1, 1, 300, 77], [900, 17, 300, 1000]
    meta, cache = paged_batch(query_lens, context_lens, block_size, kv_heads, head_dim, dtype,
                              "cuda")
    t = sum(query_lens)
    q, k, v, qw, kw, _, cos_sin = qkv_inputs(t, heads, kv_heads, head_dim, dtype)
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)]).cuda()
    backend = TritonAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    fused_cache = cache.clone()
    fq, fk = triton_fused(q, k, v, qw, kw, EPS, pos, cos_sin, fused_cache, meta.slot_mapping)
    fused_out = backend.forward(fq, fk, v, fused_cache, meta, cache_written=True)
    out = backend.forward(fq, fk, v, cache, meta)  # the same q/k, written by the backend
    assert torch.equal(fused_cache.isnan(), cache.isnan())
    assert torch.equal(fused_cache.nan_to_num(), cache.nan_to_num())
    assert torch.equal(fused_out, out)


def test_cuda_graph_replay():
    """Captured once, replayed for new positions, slots (padding included) and inputs: no
    host reads, nothing sized by tensor contents."""
    dtype, tokens, heads, kv_heads, head_dim, blocks, bs = torch.bfloat16, 64, 32, 8, 128, 16, 16
    q, k, v, qw, kw, pos, cos_sin = qkv_inputs(tokens, heads, kv_heads, head_dim, dtype, seed=1)
    slots = slots_for(tokens, blocks, bs, seed=1)
    cache = torch.full((2, blocks, bs, kv_heads, head_dim), float("nan"), dtype=dtype,
                       device="cuda")
    triton_fused(q, k, v, qw, kw, EPS, pos, cos_sin, cache, slots)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gq, gk = triton_fused(q, k, v, qw, kw, EPS, pos, cos_sin, cache, slots)
    for seed in (2, 3):
        nq, nk, nv, _, _, npos, _ = qkv_inputs(tokens, heads, kv_heads, head_dim, dtype, seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv), pos.copy_(npos)
        slots.copy_(slots_for(tokens, blocks, bs, pad_every=3 + seed, seed=seed))
        cache.fill_(float("nan"))
        graph.replay()
        ref_cache = torch.full_like(cache, float("nan"))
        eq, ek = triton_fused(q, k, v, qw, kw, EPS, pos, cos_sin, ref_cache, slots)
        assert torch.equal(gq, eq) and torch.equal(gk, ek)
        assert torch.equal(cache.isnan(), ref_cache.isnan())
        assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())


def test_unfused_write_unchanged():
    """The backend's own path still writes the cache (cache_written defaults to False)."""
    k = torch.randn(3, 4 * 64, device="cuda")
    v = torch.randn(3, 4 * 64, device="cuda")
    cache = torch.zeros(2, 2, 16, 4, 64, device="cuda")
    kv_cache.write_kv_cache(k, v, cache, torch.tensor([0, -1, 17], device="cuda"))
    assert torch.equal(cache.view(2, -1, 4, 64)[0, 17], k[2].view(4, 64))


SMS = torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_fused_into_decode_attention(dtype, head_dim, group, block_size, batch):
    kv_heads = 8 if group < 8 else 4
    lens = [(97 * i + 13) % 3000 + 1 for i in range(batch)]
    if batch > 1:
        lens[1] = 0  # a graph's padding row
    splits = num_kv_splits(batch, kv_heads, SMS)
    check_fused(lens, kv_heads * group, kv_heads, head_dim, head_dim, dtype, splits,
                block_size=block_size)


@pytest.mark.parametrize("batch,ctx", [(1, 32768), (2, 8192), (256, 1500)])
def test_fused_into_decode_attention_long_and_wide(batch, ctx):
    lens = [ctx - (37 * i) % (ctx // 2) for i in range(batch)]
    check_fused(lens, 32, 8, 128, 128, torch.bfloat16, num_kv_splits(batch, 8, SMS), block_size=16)
