"""The Triton paged attention backend against the native one on the GPU: dtypes, head dims
64/128, GQA ratios 1/4/8, block sizes 16/32/64, contexts up to 32k, batches up to 256; the
prefill kernel alone on real shapes, with 1-token rows among long ones; and the decode
kernel replayed from a CUDA graph and run repeatedly (bitwise equal)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton import decode_attention  # noqa: E402
from atom_kernels_triton.attention_backend import TritonAttentionBackend  # noqa: E402
from atom_kernels_triton.decode_attention import num_kv_splits, paged_decode_attention  # noqa: E402
from test_triton_attention import decode_inputs, decode_reference, prefill_case  # noqa: E402
from triton_reference import native_attention, paged_batch, rel_err, tolerance  # noqa: E402


def run_case(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    meta, cache = paged_batch(query_lens, context_lens, block_size, kv_heads, head_dim, dtype,
                              "cuda", seed)
    t = sum(query_lens)
    torch.manual_seed(seed)
    q = torch.randn(t, heads * head_dim, device="cuda").to(dtype)
    k = torch.randn(t, kv_heads * head_dim, device="cuda").to(dtype)
    v = torch.randn(t, kv_heads * head_dim, device="cuda").to(dtype)
    ref, ref_cache = native_attention(q, k, v, cache, meta, heads, kv_heads, head_dim)
    backend = TritonAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    out = backend.forward(q, k, v, cache, meta)
    err = rel_err(out, ref)
    assert err < tolerance(dtype), err
    written = ~ref_cache.isnan()
    assert torch.equal(written, ~cache.isnan())
    assert torch.equal(cache.float()[written], ref_cache[written])


def contexts(n, hi, seed):
    rng = random.Random(seed)
    return [rng.randint(1, hi) for _ in range(n)]


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64])  # 64: the engine's page on Hopper
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_decode_sweep(dtype, head_dim, group, block_size, batch):
    kv_heads = 8 if group < 8 else 4
    lens = contexts(batch, 3000, batch)
    run_case([1] * batch, lens, kv_heads * group, kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize("ctx", [8192, 32768])
def test_decode_long_context(ctx):
    run_case([1, 1], [ctx, ctx // 3], 32, 8, 128, 16, torch.bfloat16)


def test_decode_batch_256():
    run_case([1] * 256, contexts(256, 1500, 3), 32, 8, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64])  # 64: TMA tiles on Hopper on
def test_prefill_and_extend(dtype, head_dim, group, block_size):
    kv_heads = 4
    # fresh prompts, prompts over cached prefixes, and decodes mixed into one batch; query
    # lengths off the 128/32-row query tiles, prefixes off the 64/32-key tiles
    query_lens = [300, 1, 77, 129, 1, 16]
    context_lens = [300, 900, 77, 1200, 33, 16]
    run_case(query_lens, context_lens, kv_heads * group, kv_heads, head_dim, block_size, dtype)


def test_prefill_long_chunk_block_32():
    run_case([4096, 2048], [4096, 6000], 32, 8, 128, 32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_prefill_kernel_one_token_rows_among_long(dtype, block_size):
    # The kernel alone computes q_len 1 rows too (the backend sends those to decode).
    prefill_case([1, 2000, 1, 333, 1, 1025], [700, 2000, 1, 3400, 5000, 1025], 32, 8, 128,
                 block_size, dtype, device="cuda")


@pytest.mark.parametrize("query_len,ctx", [(16384, 16384), (2048, 32768), (511, 32000)])
def test_prefill_long_context(query_len, ctx):
    run_case([query_len, 100], [ctx, 300], 32, 8, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("batch,block_size,tma", [(2, 16, False), (24, 64, True)])
def test_decode_cuda_graph_replays_with_changing_lengths(batch, block_size, tma):
    # One capture at batch 2 (32 splits on an H200) or 24 (2 splits; TMA tiles over pages of
    # 64 where the device has TMA), replayed over new lengths - padding rows and contexts
    # shorter than the split count among them - and new queries: the split counters must
    # come back to zero after every replay, with no memset node.
    heads, kv_heads, head_dim, max_ctx = 32, 8, 128, 4000
    q, cache, meta = decode_inputs([max_ctx] * batch, heads, kv_heads, head_dim, block_size,
                                   torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_kv_splits(batch, kv_heads, sms)
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def step():
        paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                               out, scale, splits, tma=tma)

    step()  # warm-up outside the capture: compiles, and allocates the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rng = random.Random(0)
    for i in range(50):
        lens = [rng.choice([0, 1, 7, 64, rng.randint(1, max_ctx)]) for _ in range(batch)]
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = decode_reference(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                               scale)
        live = meta.seq_lens > 0
        if live.any():
            err = rel_err(out[live], ref[live])
            assert err < tolerance(torch.bfloat16), (i, lens, err)
        assert (out[~live] == 0).all(), (i, lens)
    for counters in decode_attention._COUNTERS.values():
        assert not counters.any()


@pytest.mark.parametrize("batch,num_splits", [(1, 32), (3, 16)])
def test_decode_bitwise_repeatable(batch, num_splits):
    # Whichever split arrives last merges all of them in index order: the output must not
    # depend on the arrival order, which differs from run to run on a GPU.
    q, cache, meta = decode_inputs(contexts(batch, 8000, 5), 32, 8, 128, 16, torch.bfloat16,
                                   device="cuda")
    outs = []
    for _ in range(20):
        out = torch.empty_like(q)
        paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                               out, 128**-0.5, num_splits)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
