"""The Triton attention backends over a float8_e4m3fn KV cache (``--kv_cache_dtype fp8``) on
the GPU, at Qwen3-8B's attention (32 query heads, 8 kv heads, head dim 128) and
DeepSeek-V2-Lite's MLA (16 heads, kv_lora_rank 512, rope 64), bf16 and fp16.

Writes store native ``store_rows``' bytes for every bf16 and fp16 value (NaN stays NaN).
Decode (batch 1 to 256, the preloading grids among them), prefill, extend and mixed
batches, decode with Qwen3's attention input fused in (the kernel and the backend's step),
and MLA decode equal attention over the dequantized cache and the native backend over the
same cache (tests/test_fp8_kv_cache_triton.py's checks, at these shapes); and an fp8 decode
replays from a CUDA graph. Each with scales of one, and the writes, decode, mixed batches,
the fused decode, the graph replay and MLA also with per-layer K/V (latent) scales."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton.attention_backend import TritonAttentionBackend  # noqa: E402
from atom_kernels_triton.kv_cache import write_kv_cache  # noqa: E402
from atom_kernels_triton.mla_decode import MLADecodeConfig, mla_num_splits  # noqa: E402
from test_fp8_kv_cache_triton import (  # noqa: E402
    FP8,
    K_SCALE,
    V_SCALE,
    backend_case,
    check_fused_write,
    dequantized,
    forward_input_case,
    fused_decode_case,
    mla_backend_case,
    mla_kernel_case,
)
from test_triton_attention import decode_reference  # noqa: E402
from triton_reference import paged_batch, rel_err, tolerance  # noqa: E402

from atom_core.ops.native.kv_cache import write_kv_cache as native_write  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
MLA_HEADS, RANK, ROPE = 16, 512, 64  # DeepSeek-V2-Lite
MLA_DIMS = (MLA_HEADS, 128, ROPE, 128, RANK)  # heads, qk_nope, qk_rope, v, kv_lora_rank
DTYPES = [torch.bfloat16, torch.float16]


def contexts(n, hi, seed):
    rng = random.Random(seed)
    return [rng.randint(1, hi) for _ in range(n)]


# (k_scale, v_scale): one, and per-layer scales that are not powers of two.
SCALES = [(1.0, 1.0), (K_SCALE, V_SCALE)]


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_every_16_bit_value(dtype, k_scale, v_scale):
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    width = KV_HEADS * HEAD_DIM
    k = values.cuda().view(-1, width)  # 64 tokens
    v = -k.flip(0)
    tokens = k.shape[0]
    slots = torch.randperm(tokens + 32, device="cuda")[:tokens]
    slots[::5] = -1
    cache = torch.full((2, (tokens + 32) // 16, 16, KV_HEADS, HEAD_DIM), float("nan"),
                       device="cuda").to(FP8)
    ref = cache.clone()
    write_kv_cache(k, v, cache, slots, k_scale, v_scale)
    native_write(k.view(tokens, KV_HEADS, HEAD_DIM), v.view(tokens, KV_HEADS, HEAD_DIM), ref,
                 slots, k_scale, v_scale)
    nan = ref.float().isnan()
    assert torch.equal(cache.float().isnan(), nan)
    assert torch.equal(cache.view(torch.uint8)[~nan], ref.view(torch.uint8)[~nan])


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_fused_qk_norm_rope_write(dtype, tokens, k_scale, v_scale):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width, device="cuda", generator=g).to(dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    v.mul_(300)  # past 448 in places
    qw = (1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", generator=g)).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    freqs = torch.arange(4096, device="cuda").float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos = torch.randint(0, 4096, (tokens,), device="cuda", generator=g)
    num_blocks = tokens // 16 + 4
    slots = torch.randperm(num_blocks * 16, device="cuda", generator=g)[:tokens]
    slots[1::7] = -1
    cache = torch.full((2, num_blocks, 16, KV_HEADS, HEAD_DIM), float("nan"),
                       device="cuda").to(FP8)
    check_fused_write(q, k, v, qw, kw, pos, cos_sin, cache, slots, True, dtype, k_scale,
                      v_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])  # 64: the engine's page on Hopper
@pytest.mark.parametrize("batch", [1, 7, 64, 256])  # 32, 8, 1 and 1 splits on an H200
def test_decode(dtype, block_size, batch):
    hi = 1500 if batch == 256 else 4000
    backend_case([1] * batch, contexts(batch, hi, batch), HEADS, KV_HEADS, HEAD_DIM, block_size,
                 dtype)


@pytest.mark.parametrize("batch", [1, 64])  # the preloading grid and the plain one
def test_decode_with_scales(batch):
    backend_case([1] * batch, contexts(batch, 4000, batch), HEADS, KV_HEADS, HEAD_DIM, 16,
                 torch.bfloat16, k_scale=K_SCALE, v_scale=V_SCALE)


def test_decode_long_context():
    backend_case([1, 1], [32768, 9000], HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])  # 64: TMA tiles on Hopper on
def test_prefill_extend_and_mixed(dtype, block_size):
    # Fresh prompts, prompts over cached prefixes and decodes in one batch; query lengths
    # off the 128-row query tiles, prefixes off the key tiles.
    backend_case([300, 1, 77, 129, 1, 16], [300, 900, 77, 1200, 33, 16], HEADS, KV_HEADS,
                 HEAD_DIM, block_size, dtype)


def test_prefill_extend_and_mixed_with_scales():
    backend_case([300, 1, 77, 129, 1, 16], [300, 900, 77, 1200, 33, 16], HEADS, KV_HEADS,
                 HEAD_DIM, 16, torch.bfloat16, k_scale=K_SCALE, v_scale=V_SCALE)


def test_prefill_long_chunk():
    backend_case([4096, 2048], [4096, 6000], HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 2, 8, 32])  # 8 and 32 preload the first tile
def test_fused_decode_kernel(num_splits):
    fused_decode_case([0, 1, 700, 4097, 33, 2000], HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM,
                      torch.bfloat16, num_splits, block_size=16)


@pytest.mark.parametrize("num_splits", [1, 32])
def test_fused_decode_kernel_with_scales(num_splits):
    fused_decode_case([0, 1, 700, 4097, 33, 2000], HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM,
                      torch.bfloat16, num_splits, block_size=16, k_scale=K_SCALE,
                      v_scale=V_SCALE)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("batch", [16, 64])  # 4 splits and 1 on an H200: both fused
def test_backend_decode_step_fused(batch, monkeypatch, k_scale, v_scale):
    forward_input_case(contexts(batch, 3000, batch), HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16,
                       monkeypatch, block_size=16, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_decode_replays_from_a_cuda_graph(k_scale, v_scale):
    """The backend's decode over an fp8 cache captured once, replayed over new lengths and
    new queries, against fp64 attention over the dequantized cache (the scales are the
    kernels' arguments at capture: they are fixed once weights are loaded)."""
    lens = [3000, 3000, 3000, 3000]
    meta, cache = paged_batch([1] * 4, lens, 16, KV_HEADS, HEAD_DIM, torch.float32, "cuda")
    cache = torch.randn(cache.shape, device="cuda").mul(4).to(FP8)
    q = torch.randn(4, HEADS * HEAD_DIM, device="cuda").to(torch.bfloat16)
    k = torch.zeros(4, KV_HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    backend = TritonAttentionBackend(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM**-0.5)
    backend.k_scale, backend.v_scale = k_scale, v_scale
    meta.slot_mapping.fill_(-1)  # the cache is the context: nothing written
    backend.forward(q, k, k, cache, meta)  # warm-up: compiles, allocates the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, k, cache, meta)
    rng = random.Random(0)
    for i in range(10):
        new = [rng.randint(1, 3000) for _ in range(4)]
        meta.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = decode_reference(q.view(4, HEADS, HEAD_DIM), dequantized(cache, k_scale, v_scale),
                               meta.block_tables, meta.seq_lens, meta.query_start_loc,
                               HEAD_DIM**-0.5)
        assert rel_err(out.view(4, HEADS, HEAD_DIM), ref) < tolerance(torch.bfloat16), (i, new)


@pytest.mark.parametrize("kv_scale", [1.0, K_SCALE])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_mla_decode_kernel(dtype, batch, kv_scale):
    seq_lens = contexts(batch, 4000, batch)
    if batch > 1:
        seq_lens[0] = 0  # a graph's padding row
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = mla_num_splits(batch, MLA_HEADS, sms, MLADecodeConfig.for_dtype(FP8))
    mla_kernel_case(seq_lens, MLA_HEADS, RANK, ROPE, 16, dtype, splits, kv_scale=kv_scale)


@pytest.mark.parametrize("kv_scale", [1.0, K_SCALE])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "cached,new",
    [([3, 900, 17, 4000], [1] * 4), ([0, 600, 4, 1500, 3], [200, 7, 1, 1, 40])],
    ids=["decode", "mixed"],
)
def test_mla_backend(dtype, cached, new, kv_scale):
    # Twice the tolerance, as tests/gpu/test_mla_gpu.py: the two absorb at different points.
    mla_backend_case(cached, new, 16, dtype, dims=MLA_DIMS, tol=2.0, kv_scale=kv_scale)
