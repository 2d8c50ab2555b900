"""The Triton attention backend vs the native one on paged batches: decode (split and
unsplit, GQA), prefill, extend over a cached prefix, and mixed batches; the decode kernel
alone over split counts, short and empty contexts, repeated calls (its split counters
must reset themselves) and bitwise repeatability; and the prefill kernel alone over every
page-gather path and tile edge. CPU through TRITON_INTERPRET=1
on small shapes; skipped where triton is not installed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import decode_attention  # noqa: E402
from atom_kernels_triton.attention_backend import TritonAttentionBackend  # noqa: E402
from atom_kernels_triton.decode_attention import paged_decode_attention  # noqa: E402
from atom_kernels_triton.prefill_attention import (  # noqa: E402
    is_small_grid,
    paged_prefill_attention,
    tile_config,
)
from triton_reference import native_attention, paged_batch, rel_err, tolerance  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_case(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    meta, cache = paged_batch(query_lens, context_lens, block_size, kv_heads, head_dim, dtype,
                              DEVICE, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(query_lens)
    q = torch.randn(t, heads * head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(t, kv_heads * head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(t, kv_heads * head_dim, generator=g).to(dtype).to(DEVICE)
    ref, ref_cache = native_attention(q, k, v, cache, meta, heads, kv_heads, head_dim)
    backend = TritonAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    out = backend.forward(q, k, v, cache, meta)
    assert rel_err(out, ref) < tolerance(dtype)
    written = ~ref_cache.isnan()
    assert torch.equal(written, ~cache.isnan())
    assert torch.equal(cache.float()[written], ref_cache[written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2)])
def test_decode(dtype, heads, kv_heads):
    # Contexts across tile and block edges; batch 2 on 8 "SMs" takes the split-KV path.
    run_case([1, 1], [1, 77], heads, kv_heads, 32, 16, dtype)


def test_decode_unsplit_and_padding_rows():
    # Many sequences: one split. A padding row (slot -1, seq_len 0) writes nothing.
    run_case([1] * 9, [5, 16, 17, 33, 2, 40, 1, 64, 65], 4, 1, 16, 4, torch.float32)


@pytest.mark.parametrize("num_splits", [4, 32])  # 32: the first tile is loaded before the wait
def test_decode_seq_len_zero_row_is_finite(num_splits):
    meta, cache = paged_batch([1, 1], [9, 3], 4, 1, 16, torch.float32, DEVICE)
    cache = cache.nan_to_num()  # the new tokens' slots, which no backend wrote here
    meta.seq_lens[1] = 0
    q = torch.randn(2, 2, 16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                           out, 0.25, num_splits=num_splits)
    assert torch.isfinite(out).all()


def decode_reference(q, cache, block_tables, seq_lens, query_start_loc, scale):
    """fp64 softmax attention of each sequence's query row over its first seq_lens pages'
    tokens, read straight from the paged cache; rows of empty sequences are zero."""
    kv_heads, bs = cache.shape[3], cache.shape[2]
    flat = cache.double().flatten(1, 2)  # [2, slots, kv_heads, D]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_tables[i, pos // bs].long() * bs + pos % bs
        k, v = (flat[j, slots].repeat_interleave(q.shape[1] // kv_heads, dim=1) for j in (0, 1))
        row = int(query_start_loc[i])
        p = torch.einsum("hd,nhd->hn", q[row].double(), k).mul(scale).softmax(-1)
        out[row] = torch.einsum("hn,nhd->hd", p, v)
    return out


def decode_inputs(context_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0,
                  device=DEVICE):
    """(q, cache filled everywhere, metadata) for one decode row per sequence."""
    meta, cache = paged_batch([1] * len(context_lens), [max(n, 1) for n in context_lens],
                              block_size, kv_heads, head_dim, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    cache = torch.randn(cache.shape, generator=g).to(dtype).to(device)
    meta.seq_lens.copy_(torch.tensor(context_lens, dtype=torch.int32))  # 0: a graph's padding row
    q = torch.randn(len(context_lens), heads, head_dim, generator=g).to(dtype).to(device)
    return q, cache, meta


def check_decode(q, cache, meta, num_splits, seq_idx=None):
    out = torch.full_like(q, float("nan"))
    scale = q.shape[2] ** -0.5
    paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                           scale, num_splits, seq_idx=seq_idx)
    ref = decode_reference(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    rows = torch.arange(q.shape[0], device=q.device) if seq_idx is None else seq_idx.long()
    rows = rows[rows >= 0]  # -1 entries are padding
    err = rel_err(out[rows], ref[rows])
    assert err < tolerance(q.dtype), err
    empty = rows[meta.seq_lens[rows] == 0]
    assert (out[empty] == 0).all(), "an empty sequence's row is not zero"
    for counters in decode_attention._COUNTERS.values():
        assert not counters.any(), "a split counter was left non-zero"
    return out


# Contexts of 0 (padding), shorter than one 32-token tile, shorter than the split count,
# and across tile and block edges; split counts of one, odd, and more than the tiles.
@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 8, 32])
def test_decode_kernel_split_counts_and_short_contexts(num_splits):
    q, cache, meta = decode_inputs([0, 1, 5, 31, 33, 100, 0, 2], 4, 2, 16, 4, torch.float32)
    check_decode(q, cache, meta, num_splits)


@pytest.mark.parametrize("num_splits", [4, 8])
def test_decode_kernel_back_to_back_calls(num_splits):
    # The last split of each (sequence, kv head) zeroes its counter; a second call with
    # other data and other lengths (a subset through seq_idx, as in a mixed batch) must
    # count from zero again.
    q, cache, meta = decode_inputs([70, 9, 130], 8, 2, 32, 16, torch.float16, seed=1)
    check_decode(q, cache, meta, num_splits)
    q2, cache2, meta2 = decode_inputs([3, 0, 200, 64], 8, 2, 32, 16, torch.float16, seed=2)
    check_decode(q2, cache2, meta2, num_splits,
                 seq_idx=torch.tensor([2, 1, 0], dtype=torch.int32, device=DEVICE))
    check_decode(q, cache, meta, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4, 32])
def test_decode_kernel_padding_entries_store_nothing(num_splits):
    # A captured mixed step pads its decode indices with -1 up to the graph's capacity:
    # those programs read no context and write no row.
    q, cache, meta = decode_inputs([0, 9, 40, 3, 17], 4, 2, 16, 4, torch.float32, seed=3)
    idx = torch.tensor([3, -1, 1, -1, -1, 0], dtype=torch.int32, device=DEVICE)
    out = check_decode(q, cache, meta, num_splits, seq_idx=idx)
    assert out[[2, 4]].isnan().all()


def test_split_rule():
    # The attention backend aims at ~4 programs per SM by default (bench/decode_attention.py);
    # MLA asks for 2. A power of two, at most 32, 1 once the unsplit grid is ~2 programs per SM.
    rule = decode_attention.num_kv_splits
    assert [rule(b, 8, 132) for b in (1, 4, 16, 32, 33, 64, 256)] == [32, 16, 4, 2, 1, 1, 1]
    assert rule(32, 4, 132) == 4  # Qwen3-30B-A3B's 4 kv heads
    assert [rule(b, 8, 132, waves=2) for b in (1, 4, 16, 17, 32)] == [32, 8, 2, 1, 1]
    assert rule(0, 8, 132) == 32  # no sequences: the grid is empty anyway


def test_decode_kernel_bitwise_repeatable():
    q, cache, meta = decode_inputs([90, 1, 0], 4, 1, 16, 8, torch.float32, seed=3)
    first = check_decode(q, cache, meta, 8)
    assert torch.equal(check_decode(q, cache, meta, 8), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill(dtype):
    run_case([40, 7], [40, 7], 4, 2, 32, 8, dtype)


def test_extend_over_cached_prefix():
    run_case([5, 33], [21, 70], 4, 4, 32, 16, torch.float32)


def test_mixed_batch():
    run_case([1, 12, 1, 3], [30, 12, 9, 20], 8, 2, 16, 4, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_64(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip(
            "the interpreter's tl.dot reads bf16 operands as raw bits; tests/gpu covers bf16"
        )
    run_case([1, 9], [50, 9], 4, 1, 64, 16, dtype)


def prefill_case(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype,
                 select=None, seed=0, device=DEVICE, tile=None, tma=None):
    """paged_prefill_attention alone (q_len 1 rows included) over the sequences in
    ``select`` (all by default) vs the native backend; other rows stay untouched."""
    meta, cache = paged_batch(query_lens, context_lens, block_size, kv_heads, head_dim, dtype,
                              device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n * head_dim, generator=g).to(dtype).to(device)
               for n in (heads, kv_heads, kv_heads))
    ref, ref_cache = native_attention(q, k, v, cache, meta, heads, kv_heads, head_dim)
    q3 = q.view(t, heads, head_dim)
    out = torch.full_like(q3, float("nan"))
    seqs = list(range(len(query_lens))) if select is None else select
    paged_prefill_attention(
        q3, ref_cache.to(dtype), meta.block_tables, meta.seq_lens, meta.query_start_loc,
        torch.tensor(seqs, dtype=torch.int32, device=device), max(query_lens), out, head_dim**-0.5,
        tile=tile, tma=tma,
    )
    starts = meta.query_start_loc_cpu
    picked = torch.zeros(t, dtype=torch.bool)
    for i in seqs:
        if i >= 0:  # -1 entries are padding
            picked[starts[i] : starts[i + 1]] = True
    picked = picked.to(device)
    err = rel_err(out[picked], ref.view(t, heads, head_dim)[picked])
    assert err < tolerance(dtype), err
    assert out[~picked].isnan().all()


# Tiles are 32x32 for fp32 and 128x64 for fp16: the first prompt spans several query tiles
# and ends mid-tile; contexts end mid-page and mid-tile. Block sizes 4 and 16 gather several
# pages per key tile, 64 (and 32 for fp32) one page per tile, 12 one block id per key.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [4, 12, 16, 32, 64])
def test_prefill_kernel_pages_and_tile_edges(dtype, block_size):
    first = 150 if dtype == torch.float16 else 75
    # fresh, a decode over a prefix, extend over a prefix, a 1-token prompt, fresh again
    prefill_case([first, 1, 40, 1, 70], [first, 90, 203, 1, 70], 2, 1, 32, block_size, dtype)


# The small grids' 64-row tiles (a chunk of a few hundred prompt tokens beside decodes),
# over the same edges: several query tiles, a chunk over a cached prefix, pages per key tile.
@pytest.mark.parametrize("tile", [(64, 64, 4, 3), (64, 32, 4, 3)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_kernel_small_grid_tiles(tile, block_size):
    prefill_case([150, 1, 40, 70], [150, 90, 203, 70], 2, 1, 32, block_size, torch.float16,
                 tile=tile)


# K/V tiles of 64 keys inside one page, loaded by TMA descriptors (pages of 64 tokens or
# more on a GPU with TMA; forced here, under the interpreter), over the same edges and GQA.
# The unwritten slots of each sequence's last page hold NaN (paged_batch), which no stored
# row may see.
@pytest.mark.parametrize("tile", [(128, 64, 4, 3), (64, 64, 4, 3)])
@pytest.mark.parametrize("block_size", [64, 128])
def test_prefill_kernel_tma_tiles(tile, block_size):
    prefill_case([150, 1, 40, 70], [150, 90, 203, 70], 4, 2, 32, block_size, torch.float16,
                 tile=tile, tma=True)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
def test_prefill_kernel_tma_loads_give_the_pointer_loads_output(kv_dtype, monkeypatch):
    """The same tiles over the same cache, K/V by descriptor or by pointer: the same bits in
    every stored row, over an fp8 cache with scales too."""
    from atom_kernels_triton import prefill_attention

    built = []
    real = prefill_attention.cache_descriptors
    monkeypatch.setattr(prefill_attention, "cache_descriptors",
                        lambda *a: built.append(a) or real(*a))
    query_lens, context_lens, heads, kv_heads, head_dim = [150, 1, 70], [150, 90, 203], 4, 2, 32
    meta, cache = paged_batch(query_lens, context_lens, 64, kv_heads, head_dim, torch.float16,
                              DEVICE, 0)
    g = torch.Generator().manual_seed(1)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n * head_dim, generator=g).half().to(DEVICE)
               for n in (heads, kv_heads, kv_heads))
    _, written = native_attention(q, k, v, cache, meta, heads, kv_heads, head_dim)
    cache = written.to(kv_dtype)  # NaN stays NaN in the unwritten slots, e4m3 too
    outs = []
    for tma in (False, True):
        out = torch.full((t, heads, head_dim), float("nan"), dtype=torch.float16, device=DEVICE)
        paged_prefill_attention(
            q.view(t, heads, head_dim), cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, torch.arange(3, dtype=torch.int32, device=DEVICE),
            max(query_lens), out, head_dim**-0.5, k_scale=0.5, v_scale=2.0,
            tile=(128, 64, 4, 3), tma=tma)
        outs.append(out)
    assert len(built) == 1  # the second call, and only it, read by descriptor
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])


def test_tma_tiles_where_the_device_and_pages_allow(monkeypatch):
    from atom_kernels_triton import kv_cache, prefill_attention
    from atom_kernels_triton.occupancy import DeviceLimits

    cuda = torch.device("cuda", 0)
    assert not kv_cache.prefers_tma_pages(torch.device("cpu"), 128)
    for tma in (False, True):
        monkeypatch.setattr(kv_cache, "device_limits",
                            lambda device, tma=tma: DeviceLimits(132, 227 * 1024, tma))
        # Hopper on: heads a descriptor's box covers whole; wider heads keep their tiles.
        assert kv_cache.prefers_tma_pages(cuda, 128) is tma
        assert kv_cache.prefers_tma_pages(cuda, 64) is tma
        assert not kv_cache.prefers_tma_pages(cuda, 256)
        assert not kv_cache.prefers_tma_pages(cuda, 96)
        backend = TritonAttentionBackend(32, 128, 8, 128**-0.5)
        assert backend.preferred_block_size(cuda) == (64 if tma else None)
        assert TritonAttentionBackend(8, 256, 8, 1.0).preferred_block_size(cuda) is None
    assert TritonAttentionBackend(32, 128, 8, 1.0).preferred_block_size(torch.device("cpu")) is None
    # Pages hold whole tiles from 64 tokens on; the TMA tiles are 64 keys wide.
    assert [prefill_attention.tma_page(b) for b in (16, 32, 64, 128)] == [False, False, True, True]
    if not torch.version.hip:
        assert tile_config(torch.bfloat16, 128, tma=True) == (128, 64, 4, 3)
        assert tile_config(torch.bfloat16, 128, True, 227 * 1024, tma=True) == (64, 64, 4, 3)


def test_small_grids_take_64_row_tiles():
    # Qwen3-8B's 32 heads on 132 SMs: a captured step of 1024 tokens is 256 programs of
    # 128-row tiles, under two an SM; 2048 tokens are 512.
    assert is_small_grid(32, 1024, 132) and is_small_grid(32, 1, 132)
    assert not is_small_grid(32, 2048, 132) and not is_small_grid(32, 16384, 132)
    assert tile_config(torch.bfloat16, 128) == (128, 32, 4, 3)
    if not torch.version.hip:
        assert tile_config(torch.bfloat16, 128, True, 227 * 1024) == (64, 64, 4, 3)
        # 64x64 tiles need 112 KiB: Ada and consumer Ampere (99 KiB a block) take 64x32.
        assert tile_config(torch.bfloat16, 128, True, 99 * 1024) == (64, 32, 4, 3)
    # fp32 and wide heads keep their tiles: they are already small.
    assert tile_config(torch.float32, 128, True, 227 * 1024) == (32, 32, 8, 2)
    assert tile_config(torch.bfloat16, 256, True, 227 * 1024) == (64, 32, 8, 2)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_kernel_gqa(group):
    prefill_case([37, 1, 66], [100, 9, 66], group, 1, 16, 16, torch.float32)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_head_dims(head_dim):
    prefill_case([130, 5], [300, 5], 2, 1, head_dim, 16, torch.float16)


def test_prefill_kernel_only_selected_sequences():
    prefill_case([20, 33, 1, 9], [20, 80, 4, 30], 4, 2, 16, 8, torch.float32, select=[3, 1])


def test_prefill_kernel_padding_entries_compute_nothing():
    prefill_case([20, 33, 1, 9], [20, 80, 4, 30], 4, 2, 16, 8, torch.float32,
                 select=[-1, 3, -1, 1, -1])


def test_captured_step_metadata_pads_both_kernels():
    """As a step graph runs it: the decode/prefill split comes on the device, padded with
    -1, and the prefill grid spans the padded token count, not the longest query."""
    lens, ctx = [1, 12, 1, 3], [30, 12, 9, 20]
    meta, cache = paged_batch(lens, ctx, 4, 2, 16, torch.float32, DEVICE, 0)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), n * 16, generator=g).to(DEVICE) for n in (8, 2, 2))
    ref, _ = native_attention(q, k, v, cache.clone(), meta, 8, 2, 16)
    meta.decode_seqs = torch.tensor([0, 2, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    meta.prefill_seqs = torch.tensor([3, 1, -1], dtype=torch.int32, device=DEVICE)
    meta.max_query_len = 64
    meta.query_start_loc_cpu = meta.seq_lens_cpu = None  # a captured step has no host facts
    out = TritonAttentionBackend(8, 16, 2, 16**-0.5).forward(q, k, v, cache, meta)
    assert rel_err(out, ref) < tolerance(torch.float32)


@pytest.mark.parametrize("num_decodes", range(6))
def test_plan_splits_decodes_from_prefills_with_aligned_prefill_indices(num_decodes):
    # Triton compiles a kernel variant per pointer alignment: the prefill kernel's index
    # tensor must start 16-byte aligned whatever the number of decodes before it.
    lens = [1] * num_decodes + [7, 3] + [1]  # a decode after the prefills too
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = SimpleNamespace(query_start_loc_cpu=starts, decode_seqs=None, prefill_seqs=None)
    decodes, prefills = TritonAttentionBackend._plan(meta, torch.device("cpu"))
    assert decodes.tolist() == [*range(num_decodes), num_decodes + 2]
    assert prefills.tolist() == [num_decodes, num_decodes + 1]
    assert prefills.data_ptr() % 16 == 0 and decodes.dtype == prefills.dtype == torch.int32
