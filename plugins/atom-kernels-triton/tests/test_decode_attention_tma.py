"""Decode attention with K/V tiles loaded by TMA (``_decode_kernel``'s ``TMA``): over pages
that hold whole tiles, with the slots past each context poisoned with NaN (never written),
at several split counts and tiles, over 16-bit and fp8 caches, and with Qwen3's attention
input fused in. It must match fp64 attention over the dequantized cache and the pointer
loads' result. CPU through TRITON_INTERPRET=1 (whose descriptor loads run fp16 and fp8
tiles, so the queries are fp16)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import decode_attention  # noqa: E402
from atom_kernels_triton.decode_attention import NewTokenInput, paged_decode_attention  # noqa: E402
from atom_kernels_triton.kv_cache import prefers_tma_pages  # noqa: E402
from test_decode_attention_fused_input import fused_case  # noqa: E402
from test_triton_attention import decode_reference  # noqa: E402
from triton_reference import paged_batch, rel_err, tolerance  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
# 0: a captured step's padding row; then shorter than a tile, a whole tile, one past it,
# and contexts that end inside a later tile of a page, or a page later.
CONTEXTS = [0, 1, 31, 64, 65, 150, 200]


@pytest.fixture
def built(monkeypatch):
    """The (cache, box rows) of every descriptor pair the op asked for."""
    calls = []
    real = decode_attention.cache_descriptors
    monkeypatch.setattr(decode_attention, "cache_descriptors",
                        lambda cache, rows: calls.append((cache, rows)) or real(cache, rows))
    return calls


def decode_case(block_size, kv_dtype, seed=0):
    """q (fp16), an fp16 cache holding every context's K/V and NaN in every other slot, that
    cache in ``kv_dtype``, and the batch's metadata."""
    meta, cache = paged_batch([1] * len(CONTEXTS), [max(n, 1) for n in CONTEXTS], block_size,
                              KV_HEADS, HEAD_DIM, torch.float16, DEVICE, seed)
    g = torch.Generator().manual_seed(seed + 1)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32)
    meta.seq_lens.copy_(lens)
    new = meta.slot_mapping[(lens > 0).to(DEVICE)]
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    flat[:, new] = torch.randn(2, len(new), KV_HEADS, HEAD_DIM, generator=g).half().to(DEVICE)
    q = torch.randn(len(CONTEXTS), HEADS, HEAD_DIM, generator=g).half().to(DEVICE)
    return q, cache, cache.to(kv_dtype), meta


def attend(q, cache, meta, num_splits, tile, tma, **kw):
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                           HEAD_DIM**-0.5, num_splits, tile=tile, tma=tma, **kw)
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size,tile", [(64, (64, 4, 3)), (64, (32, 4, 3)),
                                             (128, (64, 4, 2))])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_tma_tiles_match_the_reference(kv_dtype, block_size, tile, num_splits, built):
    q, _, cache, meta = decode_case(block_size, kv_dtype)
    k_scale, v_scale = (0.5, 2.0) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    out = attend(q, cache, meta, num_splits, tile, True, k_scale=k_scale, v_scale=v_scale)
    assert built == [(cache, tile[0])]
    dequantized = cache.float() * torch.tensor([k_scale, v_scale], device=DEVICE).view(
        2, 1, 1, 1, 1)
    ref = decode_reference(q, dequantized, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, HEAD_DIM**-0.5)
    rows = torch.tensor(CONTEXTS, device=DEVICE) > 0
    assert rel_err(out[rows], ref[rows]) < tolerance(torch.float16)
    assert (out[~rows] == 0).all(), "the padding row is not zero"
    pointer = attend(q, cache, meta, num_splits, tile, False, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out[rows], pointer[rows]) < tolerance(torch.float16)
    for counters in decode_attention._COUNTERS.values():
        assert not counters.any(), "a split counter was left non-zero"


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tma_tiles_with_the_fused_input(kv_dtype, num_splits, built):
    """The newest row, stored by the kernel, reaches the split's last tile through the cache
    (on a GPU across a proxy fence, the copy engine reading what the threads wrote): the TMA
    result equals the pointer loads', and the stored rows are the same."""
    contexts = [0, 1, 64, 65, 130]
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case(
        contexts, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM, torch.float16, block_size=64)
    cache = cache.nan_to_num(nan=float("nan")).to(kv_dtype)
    new = NewTokenInput(k, v, qw, kw, 1e-6, pos, cos_sin, meta.slot_mapping, True)
    outs, caches = [], []
    for tma in (False, True):
        c = cache.clone()
        outs.append(attend(q.view(len(contexts), HEADS, HEAD_DIM), c, meta, num_splits,
                           (64, 4, 3), tma, new_tokens=new))
        caches.append(c)
    assert [rows for _, rows in built] == [64]
    assert torch.equal(caches[0].float().nan_to_num(), caches[1].float().nan_to_num())
    rows = torch.tensor(contexts, device=DEVICE) > 0
    assert not outs[1][rows].isnan().any()
    assert rel_err(outs[1][rows], outs[0][rows]) < tolerance(torch.float16)
    assert (outs[1][~rows] == 0).all()


def test_tma_tiles_take_64_bit_metadata(built):
    """The engine's decode steps pass int64 lengths (``DecodeInputs``), positions and slots:
    the descriptors' 32-bit offsets are cast from them, not refused at compile time."""
    contexts = [1, 65, 130]
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case(
        contexts, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM, torch.float16, block_size=64)
    meta.seq_lens = meta.seq_lens.long()
    meta.block_tables = meta.block_tables.long()
    new = NewTokenInput(k, v, qw, kw, 1e-6, pos.long(), cos_sin, meta.slot_mapping.long(), True)
    outs = [attend(q.view(len(contexts), HEADS, HEAD_DIM), cache.clone(), meta, 1, (64, 4, 3),
                   tma, new_tokens=new) for tma in (False, True)]
    assert [rows for _, rows in built] == [64]
    assert rel_err(outs[1], outs[0]) < tolerance(torch.float16)


def test_descriptors_are_built_once_and_free_the_cache():
    """A layer's descriptors are built once per box, address its K and V halves, and do not
    keep the cache alive: an engine's caches are freed with the engine."""
    cache = torch.zeros(2, 4, 64, KV_HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    k_desc, v_desc = decode_attention.cache_descriptors(cache, 64)
    again = decode_attention.cache_descriptors(cache, 64)
    assert again[0] is k_desc and again[1] is v_desc
    assert decode_attention.cache_descriptors(cache, 32)[0].block_shape == [32, HEAD_DIM]
    assert k_desc.base.data_ptr() == cache[0].data_ptr()
    assert v_desc.base.data_ptr() == cache[1].data_ptr()
    assert list(k_desc.shape) == [4 * 64, KV_HEADS * HEAD_DIM]
    assert k_desc.block_shape == [64, HEAD_DIM]
    alive = weakref.ref(cache)
    del cache, k_desc, v_desc, again
    gc.collect()
    assert alive() is None


def test_a_call_that_does_not_ask_follows_the_device_rule(built, monkeypatch):
    """tma=None takes TMA tiles exactly where ``prefers_tma_pages`` says the device does
    (Hopper on; never the interpreter's CPU tensors), and gives pointer loads' output."""
    q, cache, _, meta = decode_case(64, torch.float16)
    assert not prefers_tma_pages(q.device, HEAD_DIM)
    pointer = attend(q, cache, meta, 1, (64, 4, 3), None)
    assert built == []
    asked = []
    monkeypatch.setattr(decode_attention, "prefers_tma_pages",
                        lambda device, head_dim: asked.append(head_dim) or True)
    tiles = attend(q, cache, meta, 1, (64, 4, 3), None)
    assert asked == [HEAD_DIM] and [rows for _, rows in built] == [64]
    assert rel_err(tiles, pointer) < tolerance(torch.float16)
    attend(q, cache, meta, 1, (64, 4, 3), False)  # False: pointer loads whatever the rule
    assert len(built) == 1


def test_pointer_loads_where_tma_tiles_do_not_apply(built):
    """Pages that split a tile, a sliding window, the preloading (many-split) grids and fp32
    queries keep pointer loads, even when TMA is asked for."""
    q, cache, _, meta = decode_case(64, torch.float16)
    attend(q, cache, meta, 1, (64, 4, 3), True, sliding_window=40)
    attend(q, cache, meta, 8, (64, 4, 3), True)
    attend(q.float(), cache.float(), meta, 1, (64, 4, 3), True)
    q16, cache16, _, meta16 = decode_case(16, torch.float16)
    attend(q16, cache16, meta16, 1, (32, 4, 3), True)
    assert built == []
