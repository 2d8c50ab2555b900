"""The Triton MLA decode kernel against softmax over the gathered latents, the latent cache
write, the Triton MLA backend against the native one on decode-only and mixed paged
batches, and a tiny DeepSeek-V2 through the engine's decode path on it. CPU through
TRITON_INTERPRET=1 on small shapes; skipped where triton is not installed."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import hooks  # noqa: E402
from atom_kernels_triton.mla_backend import TritonMLABackend  # noqa: E402
from atom_kernels_triton.mla_decode import (  # noqa: E402
    MLADecodeConfig,
    mla_decode_attention,
    write_latent_cache,
)
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers.attention.mla_native import NativeMLABackend  # noqa: E402
from atom_core.plugins import reset_plugins  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from atom_core.testing.engine_reference import hf_greedy, hf_model  # noqa: E402
from atom_core.testing.paged_kv import PagedKV  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def skip_bf16_on_cpu(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip(
            "the interpreter's tl.dot reads bf16 operands as raw bits; tests/gpu covers bf16"
        )


# --- the kernel ---------------------------------------------------------------------------


def latent_batch(seq_lens, block_size, rank, rope, dtype, seed=0, device=DEVICE):
    """A paged latent cache whose first seq_lens[i] slots of sequence i hold random latents,
    over shuffled blocks, and NaN in every other slot; a sequence of length 0 gets a block
    of NaN (a graph's padding row: it must read nothing). (cache, block tables, seq_lens)"""
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    start = 0
    for i, (n, nb) in enumerate(zip(seq_lens, need)):
        table = order[start : start + nb]
        start += nb
        tables[i, :nb] = table.int()
        used[table] = (torch.arange(nb * block_size) < n).view(nb, block_size)
    dev_g = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=dev_g, device=device)
    cache[~used.to(device)] = float("nan")
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return cache.to(dtype), tables.to(device), lens.to(device)


def reference_decode(q_latent, q_pe, cache, tables, seq_lens, scale):
    """Per sequence: gather its latents, softmax of q_latent.kv_c + q_pe.k_pe, weighted
    sum of kv_c (fp64, on the inputs' device); zeros for an empty context."""
    rank = q_latent.shape[-1]
    block_size = cache.shape[1]
    out = torch.zeros(q_latent.shape, dtype=torch.float64, device=q_latent.device)
    for s, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=cache.device)
        rows = cache[tables[s].long()[pos // block_size],
                     pos % block_size].double()  # [n, rank + rope]
        query = torch.cat((q_latent[s], q_pe[s]), -1).double()  # [H, rank + rope]
        probs = (query @ rows.T * scale).softmax(-1)
        out[s] = probs @ rows[:, :rank]
    return out


def run_kernel(seq_lens, heads, rank, rope, block_size, dtype, splits, config=None, seed=0):
    cache, tables, lens = latent_batch(seq_lens, block_size, rank, rope, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q_latent = torch.randn(len(seq_lens), heads, rank, generator=g).to(dtype).to(DEVICE)
    q_pe = torch.randn(len(seq_lens), heads, rope, generator=g).to(dtype).to(DEVICE)
    scale = (rank + rope) ** -0.5
    out = mla_decode_attention(q_latent, q_pe, cache, tables, lens, scale, splits, config=config)
    assert out.shape == q_latent.shape and out.dtype == dtype
    ref = reference_decode(q_latent, q_pe, cache, tables, lens, scale)
    return out, ref


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_kernel_fp32(block_size, splits):
    # Contexts of 0 (padding row), 1, and across tile and block edges.
    out, ref = run_kernel([0, 1, 17, 70, 33], 4, 32, 16, block_size, torch.float32, splits)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_16_bit(dtype):
    skip_bf16_on_cpu(dtype)
    out, ref = run_kernel([1, 45, 0, 90], 8, 32, 16, 16, dtype, splits=4)
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("heads", [2, 16, 20])
def test_kernel_head_blocks(heads):
    # 20 heads: two tiles of 16, the second one part padding.
    out, ref = run_kernel([9, 40], heads, 32, 16, 16, torch.float32, splits=2)
    assert rel_err(out, ref) < 1e-5


def test_kernel_odd_rank_and_rope():
    # Neither a power of two nor a tl.dot minimum (the tiny DeepSeek configs have rope 8).
    out, ref = run_kernel([5, 29], 4, 24, 8, 16, torch.float32, splits=2)
    assert rel_err(out, ref) < 1e-5


def test_kernel_config_override():
    config = MLADecodeConfig(block_h=32, block_n=16, num_warps=8, num_stages=1, merge_block_v=16)
    out, ref = run_kernel([0, 50, 3], 20, 32, 16, 16, torch.float32, splits=4, config=config)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_kernel_all_rows_padding_are_zero():
    # What a graph's capture runs: every row has context 0 and a table of NaN blocks.
    out, _ = run_kernel([0, 0, 0], 4, 32, 16, 16, torch.float32, splits=4)
    assert torch.equal(out, torch.zeros_like(out))


def test_write_latent_cache_skips_padding_slots():
    cache = torch.randn(4, 4, 24 + 8, device=DEVICE)
    before = cache.clone()
    kv_c, k_pe = torch.randn(4, 24, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    write_latent_cache(kv_c, k_pe, cache, torch.tensor([5, -1, 9, -1], device=DEVICE))
    flat, flat_before = cache.view(16, -1), before.view(16, -1)
    assert torch.equal(flat[5], torch.cat((kv_c[0], k_pe[0])))
    assert torch.equal(flat[9], torch.cat((kv_c[2], k_pe[2])))
    untouched = [s for s in range(16) if s not in (5, 9)]
    assert torch.equal(flat[untouched], flat_before[untouched])


# --- the backend --------------------------------------------------------------------------

DIMS = (4, 16, 16, 12, 32)  # heads, qk_nope, qk_rope, v, kv_lora_rank


class Batch:
    """Sequences with ``cached[i]`` latents already in a NaN-filled cache, computing
    ``new[i]`` tokens in one batch: the inputs of MLABackend.forward."""

    def __init__(self, cached, new, block_size, dtype=torch.float32, seed=0, dims=DIMS,
                 device=DEVICE):
        heads, nope, rope, v, rank = self.dims = dims
        g = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new)) + 2
        kv = PagedKV(num_blocks=num_blocks, block_size=block_size, seed=seed)
        ids = [kv.add_sequence() for _ in cached]
        self.cache = torch.full((num_blocks, block_size, rank + rope), float("nan"), dtype=dtype,
                                device=device)
        prefix = [(s, n) for s, n in zip(ids, cached) if n]
        if prefix:
            meta, _ = kv.step([s for s, _ in prefix], [n for _, n in prefix], device)
            total = sum(n for _, n in prefix)
            NativeMLABackend.write_cache(
                torch.randn(total, rank, generator=g).to(device),
                torch.randn(total, rope, generator=g).to(device),
                self.cache, meta.slot_mapping,
            )
        self.meta, _ = kv.step(ids, new, device)
        t = sum(new)

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(dtype).to(device)

        self.inputs = (
            rand(t, heads, nope), rand(t, heads, rope), rand(t, rank), rand(t, rope),
            rand(heads * (nope + v), rank) / rank**0.5,
        )

    def backend(self, cls):
        heads, nope, rope, v, rank = self.dims
        return cls(heads, nope, rope, v, rank, (nope + rope) ** -0.5)

    def run(self, backend_cls, meta=None):
        cache = self.cache.clone()
        out = self.backend(backend_cls).forward(*self.inputs, cache, meta or self.meta)
        return out, cache


def same_cache(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "cached,new",
    [([4, 36, 0, 17, 63], [1] * 5), ([0, 16, 4, 36, 3], [10, 7, 1, 1, 5])],
    ids=["decode", "mixed"],
)
def test_backend_matches_native(block_size, cached, new):
    batch = Batch(cached, new, block_size, seed=block_size)
    out, cache = batch.run(TritonMLABackend)
    ref, ref_cache = batch.run(NativeMLABackend)
    assert out.shape == ref.shape == (sum(new), DIMS[0] * DIMS[3])
    assert rel_err(out, ref) < 1e-5
    assert same_cache(cache, ref_cache)


def test_backend_decode_fp16():
    batch = Batch([4, 36, 70], [1, 1, 1], 16, dtype=torch.float16, seed=3)
    out, _ = batch.run(TritonMLABackend)
    ref, _ = batch.run(NativeMLABackend)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < tolerance(torch.float16)


def test_backend_decode_reads_no_host_facts():
    """A captured graph replays with the capture's placeholder host facts: the decode-only
    path must give the same result whatever seq_lens_cpu and max_seq_len say."""
    batch = Batch([4, 36, 17], [1, 1, 1], 16, seed=5)
    ref, _ = batch.run(NativeMLABackend)
    m = batch.meta
    stale = type(m)(
        m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables, m.block_size,
        max_query_len=1, max_seq_len=4096, query_start_loc_cpu=m.query_start_loc_cpu,
        seq_lens_cpu=[4096] * 3,
    )
    out, _ = batch.run(TritonMLABackend, stale)
    assert rel_err(out, ref) < 1e-5


def test_backend_padding_row_writes_nothing_and_is_zero():
    """A graph's padding row: slot -1, context 0, a stale block table. Its output is zero,
    it stores nothing, and the real rows are unchanged by it."""
    batch = Batch([4, 36], [1, 1], 16, seed=7)
    ref, ref_cache = batch.run(NativeMLABackend)
    m = batch.meta
    dev = m.seq_lens.device
    padded = type(m)(
        slot_mapping=torch.cat((m.slot_mapping, torch.tensor([-1], device=dev))),
        query_start_loc=torch.arange(4, dtype=torch.int32, device=dev),
        seq_lens=torch.cat((m.seq_lens, torch.tensor([0], dtype=m.seq_lens.dtype, device=dev))),
        block_tables=torch.cat((m.block_tables, m.block_tables[1:])),  # NaN past its length
        block_size=m.block_size, max_query_len=1, max_seq_len=m.max_seq_len,
        query_start_loc_cpu=[0, 1, 2, 3], seq_lens_cpu=[*m.seq_lens_cpu, 0],
    )
    q_nope, q_pe, kv_c, k_pe, w = batch.inputs
    batch.inputs = (
        torch.cat((q_nope, q_nope[:1])), torch.cat((q_pe, q_pe[:1])),
        torch.cat((kv_c, torch.randn_like(kv_c[:1]))),
        torch.cat((k_pe, torch.randn_like(k_pe[:1]))), w,
    )
    out, cache = batch.run(TritonMLABackend, padded)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert rel_err(out[:2], ref) < 1e-5
    assert same_cache(cache, ref_cache)


# --- the engine ---------------------------------------------------------------------------


@pytest.fixture
def triton_mla_on_cpu(monkeypatch):
    """Register the Triton attention backends for the CPU (the interpreter runs them), but
    no Triton ops: the MoE and norms stay native, so only attention is under test."""
    monkeypatch.setattr(hooks, "unavailable_reason", lambda: None)
    monkeypatch.setattr(hooks, "DEVICE_KINDS", ("cpu", "cuda", "hip"))
    monkeypatch.setattr(hooks, "triton_ops", dict)
    reset_plugins()
    yield
    reset_plugins()


def test_deepseek_v2_fast_decode_matches_transformers(triton_mla_on_cpu):
    path = tiny_model_dir("deepseek_v2")
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 40)]
    engine = LLMEngine(str(path), enable_log_stats=False, device=DEVICE, block_size=16)
    assert engine.runner.attention_backend_name == "triton_mla"
    if DEVICE == "cpu":  # the GPU decode path: persistent inputs, decode-only batches
        engine.runner.fast_decode = True
        engine.runner._setup_fast_decode()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == hf_greedy(hf_model(path), prompts, 6)
