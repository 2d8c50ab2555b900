"""The Triton MLA decode on the GPU: the kernel against softmax over the gathered latents at
DeepSeek's shapes (16 and 128 heads, kv_lora_rank 512, rope 64; contexts up to 32k,
batches up to 256; bf16/fp16/fp32; block sizes 16/32), the backend's decode captured in a
CUDA graph and replayed over other contents, and a tiny DeepSeek-V2 through the engine:
CUDA-graph decode == --enforce-eager == the native_mla backend == transformers (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton.mla_backend import TritonMLABackend  # noqa: E402
from atom_kernels_triton.mla_decode import MLADecodeConfig, mla_decode_attention, mla_num_splits  # noqa: E402
from test_mla_decode_triton import Batch, latent_batch, reference_decode  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers.attention.mla_native import NativeMLABackend  # noqa: E402
from atom_core.plugins import get_registries  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from atom_core.testing.engine_reference import hf_greedy, hf_model  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402

RANK, ROPE = 512, 64
NEW_TOKENS = 24
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def run_case(seq_lens, heads, block_size, dtype, splits=None, seed=0):
    cache, tables, lens = latent_batch(seq_lens, block_size, RANK, ROPE, dtype, seed, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q_latent = torch.randn(len(seq_lens), heads, RANK, generator=g, device="cuda").to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, ROPE, generator=g, device="cuda").to(dtype)
    scale = 192**-0.5  # DeepSeek's (qk_nope 128 + rope 64)^-0.5
    if splits is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = mla_num_splits(len(seq_lens), heads, sms, MLADecodeConfig.for_dtype(dtype))
    out = mla_decode_attention(q_latent, q_pe, cache, tables, lens, scale, splits)
    ref = reference_decode(q_latent, q_pe, cache, tables, lens, scale)
    err = rel_err(out, ref)
    assert err < tolerance(dtype), err
    for s, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))


def contexts(n, hi, seed):
    rng = random.Random(seed)
    return [rng.randint(1, hi) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_decode_sweep(dtype, heads, block_size, batch):
    run_case(contexts(batch, 3000, batch), heads, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ctx", [8192, 32768])
def test_decode_long_context(dtype, ctx):
    run_case([ctx, ctx // 3 + 5, 1], 16, 16, dtype)
    run_case([ctx], 128, 32, dtype)


def test_decode_batch_256_with_padding_rows():
    lens = contexts(256, 2000, 256)
    lens[100:104] = [0, 1, 0, 2]
    run_case(lens, 16, 16, torch.bfloat16)
    run_case(lens, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("splits", [1, 2, 5, 32])
def test_decode_explicit_splits(splits):
    run_case([0, 1, 700, 4097], 16, 16, torch.bfloat16, splits=splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_decode_matches_native(dtype):
    dims = (16, 128, ROPE, 128, RANK)  # DeepSeek-V2-Lite's attention
    batch = Batch([3, 900, 17, 4000], [1, 1, 1, 1], 16, dtype=dtype, dims=dims, device="cuda")
    out, cache = batch.run(TritonMLABackend)
    ref, ref_cache = batch.run(NativeMLABackend)
    assert rel_err(out, ref) < 2 * tolerance(dtype)
    assert torch.equal(cache.isnan(), ref_cache.isnan())


def test_backend_decode_replays_in_a_cuda_graph():
    """Captured over padding rows (slot -1, context 0), as the runner captures; replayed
    after the real batch is copied into the same tensors: equal to native, eager."""
    dims = (16, 128, ROPE, 128, RANK)
    batch = Batch([3, 900, 17, 4000], [1, 1, 1, 1], 16, dtype=torch.bfloat16, dims=dims,
                  device="cuda")
    ref, ref_cache = batch.run(NativeMLABackend)
    real = batch.meta
    meta = type(real)(
        slot_mapping=torch.full_like(real.slot_mapping, -1),
        query_start_loc=real.query_start_loc.clone(),
        seq_lens=torch.zeros_like(real.seq_lens), block_tables=torch.zeros_like(real.block_tables),
        block_size=real.block_size, max_query_len=1, max_seq_len=8192,
        query_start_loc_cpu=real.query_start_loc_cpu, seq_lens_cpu=[8192] * 4,
    )
    inputs = [x.clone() for x in batch.inputs]
    cache = batch.cache.clone()
    backend = batch.backend(TritonMLABackend)
    with torch.inference_mode():
        backend.forward(*inputs, cache, meta)  # warm-up: compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(*inputs, cache, meta)
        torch.cuda.synchronize()
        assert torch.equal(cache.isnan(), batch.cache.isnan())  # padding stored nothing
        meta.slot_mapping.copy_(real.slot_mapping)
        meta.seq_lens.copy_(real.seq_lens)
        meta.block_tables.copy_(real.block_tables)
        graph.replay()
        torch.cuda.synchronize()
    assert rel_err(out, ref) < 2 * tolerance(torch.bfloat16)
    assert torch.equal(cache.isnan(), ref_cache.isnan())


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in (5, 40, 17)]


def engine_tokens(path, dtype: str, **kwargs) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(
        str(path), enable_log_stats=False, device="cuda", dtype=dtype, max_num_seqs=8,
        cudagraph_capture_sizes=[1, 2, 4, 8], num_gpu_blocks_override=256, **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o["token_ids"] for o in engine.generate(prompts(), params)], engine


def test_deepseek_v2_graph_equals_eager_equals_native_fp32(monkeypatch):
    path = tiny_model_dir("deepseek_v2")
    graph, engine = engine_tokens(path, "float32")
    assert engine.runner.attention_backend_name == "triton_mla"
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 2, 4, 8]
    eager, engine = engine_tokens(path, "float32", enforce_eager=True)
    assert engine.runner.graphs is None
    assert graph == eager
    monkeypatch.delitem(get_registries().attention_backends.backends, "triton_mla")
    native, engine = engine_tokens(path, "float32")
    assert engine.runner.attention_backend_name == "native_mla"
    assert graph == native
    assert graph == hf_greedy(hf_model(path, device="cuda"), prompts(), NEW_TOKENS)
