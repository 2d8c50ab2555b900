"""Attention sinks and sliding windows in the Triton backend on the GPU at gpt-oss-20b's
shapes (64 query heads, 8 kv heads, head dim 64, window 128 on every other layer, sinks on
all), against the native backend in fp32: decodes at batch 1/7/64 over contexts below and
far past the window, prompts, chunks over cached prefixes and mixed batches, an fp8 cache
with scales, and the decode step replayed from a CUDA graph over changing lengths.
Tolerances: ``triton_reference.tolerance`` (relative error of the whole output)."""

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
from test_attention_sinks_window import decode_reference, sink_logits, with_extras  # noqa: E402
from triton_reference import paged_batch, rel_err, tolerance  # noqa: E402

from atom_core.layers.attention.native import NativeAttentionBackend  # noqa: E402
from atom_core.ops.native.kv_cache import FP8_KV_DTYPE  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128  # gpt-oss-20b
DTYPES = [torch.bfloat16, torch.float16]


def run_case(query_lens, context_lens, dtype, window, block_size=16, seed=0, fp8=False,
             k_scale=1.0, v_scale=1.0):
    meta, cache = paged_batch(query_lens, context_lens, block_size, KV_HEADS, HEAD_DIM,
                              torch.float32 if fp8 else dtype, "cuda", seed)
    if fp8:
        cache = (cache * 4).to(FP8_KV_DTYPE)
    torch.manual_seed(seed)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n * HEAD_DIM, device="cuda").to(dtype)
               for n in (HEADS, KV_HEADS, KV_HEADS))
    sinks = sink_logits(HEADS, seed, "cuda").to(torch.bfloat16)  # the checkpoint's dtype
    scale = HEAD_DIM**-0.5
    nat = with_extras(NativeAttentionBackend(HEADS, HEAD_DIM, KV_HEADS, scale), sinks, window)
    tri = with_extras(TritonAttentionBackend(HEADS, HEAD_DIM, KV_HEADS, scale), sinks, window)
    for b in (nat, tri):
        b.k_scale, b.v_scale = k_scale, v_scale
    if fp8:
        # Both over the same fp8 cache: native reads its keys from it for decodes and chunks
        # over a prefix (the only rows these cases hold).
        ref = nat.forward(q.float(), k.float(), v.float(), cache.clone(), meta)
    else:
        ref = nat.forward(q.float(), k.float(), v.float(), cache.clone().float(), meta)
    out = tri.forward(q, k, v, cache, meta)
    err = rel_err(out, ref)
    assert err < tolerance(dtype), err


def contexts(n, hi, seed):
    rng = random.Random(seed)
    return [rng.choice([rng.randint(1, WINDOW), rng.randint(1, hi)]) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [WINDOW, None])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode(dtype, window, batch, block_size):
    lens = contexts(batch, 3000, batch) if batch > 1 else [2900]
    run_case([1] * batch, lens, dtype, window, block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [WINDOW, None])
@pytest.mark.parametrize("block_size", [16, 64])  # 64: TMA tiles on Hopper on
def test_prefill_extend_and_mixed(dtype, window, block_size):
    # Fresh prompts shorter and longer than the window, chunks starting mid-sequence over
    # cached prefixes, and decodes, in one batch; lengths off the query and key tiles.
    query_lens = [300, 1, 77, 129, 1, 16, 2000, 100]
    context_lens = [300, 900, 77, 1200, 33, 16, 2000, 4100]
    run_case(query_lens, context_lens, dtype, window, block_size)


def test_long_context():
    run_case([1, 1, 2048], [32768, 9000, 16384], torch.bfloat16, WINDOW)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.9)])
def test_fp8_cache(k_scale, v_scale):
    run_case([1, 1, 40, 1, 300], [5, 2000, 500, 128, 1000], torch.bfloat16, WINDOW, fp8=True,
             k_scale=k_scale, v_scale=v_scale)


def test_decode_cuda_graph_replays_with_changing_lengths():
    """The backend's decode step captured once at batch 2 (the preloading grid on an H200)
    and replayed over new lengths, below and past the window, empty ones among them: the
    sinks and window are launch arguments of the captured kernel."""
    lens = [4000, 4000]
    meta, cache = paged_batch([1, 1], lens, 16, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    cache.copy_(torch.randn_like(cache, dtype=torch.float32))
    q = torch.randn(2, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(2, KV_HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    meta.slot_mapping.fill_(-1)  # nothing written: the cache stays the reference's
    sinks = sink_logits(HEADS, 0, "cuda").to(torch.bfloat16)
    tri = with_extras(TritonAttentionBackend(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM**-0.5), sinks,
                      WINDOW)
    out = torch.empty_like(q)

    def step():
        out.copy_(tri.forward(q, kv, kv, cache, meta))

    step()  # warm-up outside the capture: compiles, and allocates the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rng = random.Random(0)
    for i in range(30):
        new = [rng.choice([0, 1, 100, 128, 129, rng.randint(1, 4000)]) for _ in range(2)]
        meta.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = decode_reference(q.view(2, HEADS, HEAD_DIM), cache, meta, HEAD_DIM**-0.5, sinks,
                               WINDOW)
        got = out.view(2, HEADS, HEAD_DIM)
        live = meta.seq_lens > 0
        if live.any():
            err = rel_err(got[live], ref[live])
            assert err < tolerance(torch.bfloat16), (i, new, err)
        assert (got[~live] == 0).all(), (i, new)
    for counters in decode_attention._COUNTERS.values():
        assert not counters.any()
