"""The native backend against a dense causal reference, on mixed paged batches."""

import pytest
import torch

from atom_core.layers.attention.native import NativeAttentionBackend
from atom_core.testing.paged_kv import PagedKV


def dense_reference(q, k, v, scale):
    """q [Lq, H, D] are the last Lq of the L tokens of k/v [L, kvh, D]; causal, fp64."""
    query_len, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.ones(query_len, length, dtype=torch.bool).tril(length - query_len)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


# (context length before this step, tokens computed this step)
MIXED = [(0, 10), (16, 7), (4, 1), (36, 1), (0, 1), (3, 5), (0, 2)]
DECODES = [(4, 1), (36, 1), (0, 1), (17, 1), (8, 1)]
PREFILLS = [(0, 9), (13, 3), (5, 20)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", [MIXED, DECODES, PREFILLS], ids=["mixed", "decode", "prefill"])
def test_native_matches_dense_reference(heads, kv_heads, block_size, batch):
    head_dim, scale = 16, 16**-0.5
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    backend = NativeAttentionBackend(heads, head_dim, kv_heads, scale)
    kv = PagedKV(num_blocks=48, block_size=block_size, seed=block_size)
    shape = backend.kv_cache_shape(kv.num_blocks, block_size, kv_heads, head_dim)
    # Never-written memory may hold NaN: any slot the masks let through would spoil the result.
    cache = torch.full(shape, float("nan"))
    data_ptr = cache.data_ptr()
    ids = [kv.add_sequence() for _ in batch]
    full_k = [torch.randn(p + n, kv_heads, head_dim, generator=g) for p, n in batch]
    full_v = [torch.randn(p + n, kv_heads, head_dim, generator=g) for p, n in batch]

    # Earlier steps cached each sequence's prefix.
    cached = [(sid, p) for sid, (p, _) in zip(ids, batch) if p]
    if cached:
        meta, _ = kv.step([s for s, _ in cached], [p for _, p in cached])
        k0 = torch.cat([full_k[s][:p] for s, p in cached])
        v0 = torch.cat([full_v[s][:p] for s, p in cached])
        NativeAttentionBackend.write_cache(k0, v0, cache, meta.slot_mapping)

    meta, _ = kv.step(ids, [n for _, n in batch])
    q = [torch.randn(n, heads, head_dim, generator=g) for _, n in batch]
    k_new = torch.cat([k[p:] for k, (p, _) in zip(full_k, batch)])
    v_new = torch.cat([v[p:] for v, (p, _) in zip(full_v, batch)])
    out = backend.forward(
        torch.cat(q).flatten(1), k_new.flatten(1), v_new.flatten(1), cache, meta
    )

    assert cache.data_ptr() == data_ptr
    assert out.shape == (sum(n for _, n in batch), heads * head_dim)
    for i, rows in enumerate(out.split([n for _, n in batch])):
        ref = dense_reference(q[i], full_k[i], full_v[i], scale)
        torch.testing.assert_close(rows.view_as(q[i]).double(), ref, atol=1e-5, rtol=1e-5)
    # Every token's K/V is in the cache at its slot.
    for sid in ids:
        for pos in range(kv.lens[sid]):
            block = kv.tables[sid][pos // block_size]
            torch.testing.assert_close(cache[0, block, pos % block_size], full_k[sid][pos])
            torch.testing.assert_close(cache[1, block, pos % block_size], full_v[sid][pos])


def test_bf16_cache_with_fp32_queries():
    backend = NativeAttentionBackend(4, 8, 2, 8**-0.5)
    kv = PagedKV(num_blocks=8, block_size=4)
    sid = kv.add_sequence()
    meta, _ = kv.step([sid], [6])
    cache = torch.zeros(backend.kv_cache_shape(8, 4, 2, 8), dtype=torch.bfloat16)
    q, k, v = torch.randn(6, 32), torch.randn(6, 16), torch.randn(6, 16)
    out = backend.forward(q, k, v, cache, meta)
    ref = dense_reference(q.view(6, 4, 8), k.view(6, 2, 8), v.view(6, 2, 8), 8**-0.5)
    torch.testing.assert_close(out.view(6, 4, 8).double(), ref, atol=1e-5, rtol=1e-5)
    meta, _ = kv.step([sid], [1])
    out = backend.forward(torch.randn(1, 32), torch.randn(1, 16), torch.randn(1, 16), cache, meta)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_padding_slots_are_not_written():
    kv_cache = torch.randn(2, 4, 4, 2, 8)
    before = kv_cache.clone()
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    NativeAttentionBackend.write_cache(k, v, kv_cache, torch.tensor([5, -1, 9, -1]))
    flat, flat_before = kv_cache.view(2, 16, 2, 8), before.view(2, 16, 2, 8)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 9], v[2])
    untouched = [s for s in range(16) if s not in (5, 9)]
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])
    # An all-padding batch (a profiling run) may scribble on slot 0, and nowhere else.
    snapshot = flat.clone()
    NativeAttentionBackend.write_cache(k, v, kv_cache, torch.full((4,), -1))
    assert torch.equal(flat[:, 1:], snapshot[:, 1:])


def e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache holds for x under ``scale``: x times the fp32 reciprocal, saturated."""
    return (x.float() * torch.tensor(1 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.9)])
@pytest.mark.parametrize("batch", [MIXED, DECODES, PREFILLS], ids=["mixed", "decode", "prefill"])
def test_fp8_cache_attends_over_what_it_stored(batch, k_scale, v_scale):
    """``--kv_cache_dtype fp8``: K/V stored as e4m3 of ``x / scale`` (saturated), and every
    query (decodes, chunks after a cached prefix, a prompt computed in one step) attends
    over those values times the scale: the same keys whatever the chunking."""
    heads, kv_heads, head_dim, block_size, scale = 8, 2, 16, 4, 16**-0.5
    g = torch.Generator().manual_seed(7)
    backend = NativeAttentionBackend(heads, head_dim, kv_heads, scale)
    backend.k_scale, backend.v_scale = k_scale, v_scale
    kv = PagedKV(num_blocks=48, block_size=block_size, seed=3)
    shape = backend.kv_cache_shape(kv.num_blocks, block_size, kv_heads, head_dim)
    cache = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    ids = [kv.add_sequence() for _ in batch]
    # Some values past e4m3's range (448): stored saturated, not as NaN.
    full_k = [torch.randn(p + n, kv_heads, head_dim, generator=g) * 200 for p, n in batch]
    full_v = [torch.randn(p + n, kv_heads, head_dim, generator=g) for p, n in batch]
    cached = [(sid, p) for sid, (p, _) in zip(ids, batch) if p]
    if cached:
        meta, _ = kv.step([s for s, _ in cached], [p for _, p in cached])
        NativeAttentionBackend.write_cache(torch.cat([full_k[s][:p] for s, p in cached]),
                                           torch.cat([full_v[s][:p] for s, p in cached]),
                                           cache, meta.slot_mapping, k_scale, v_scale)
    meta, _ = kv.step(ids, [n for _, n in batch])
    q = [torch.randn(n, heads, head_dim, generator=g) / 50 for _, n in batch]
    k_new = torch.cat([k[p:] for k, (p, _) in zip(full_k, batch)])
    v_new = torch.cat([v[p:] for v, (p, _) in zip(full_v, batch)])
    out = backend.forward(torch.cat(q).flatten(1), k_new.flatten(1), v_new.flatten(1), cache,
                          meta)

    assert torch.isfinite(cache.float()).all()
    for i, rows in enumerate(out.split([n for _, n in batch])):
        k = e4m3(full_k[i], k_scale).double() * k_scale
        v = e4m3(full_v[i], v_scale).double() * v_scale
        ref = dense_reference(q[i], k, v, scale)
        torch.testing.assert_close(rows.view_as(q[i]).double(), ref, atol=1e-5, rtol=1e-5)
        for pos in range(kv.lens[ids[i]]):
            block = kv.tables[ids[i]][pos // block_size]
            for j, (x, s) in enumerate(((full_k[i], k_scale), (full_v[i], v_scale))):
                held = cache[j, block, pos % block_size].view(torch.uint8)
                assert torch.equal(held, e4m3(x[pos], s).view(torch.uint8))
