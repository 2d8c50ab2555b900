"""Attention sinks and sliding windows (gpt-oss) in the Triton attention backend, CPU
through TRITON_INTERPRET=1 on small shapes.

- The backend against the native one (the torch reference, in fp32) on random paged
  caches: decodes over contexts shorter and longer than the window, whole prompts, chunks
  starting mid-sequence over a cached prefix, mixed batches, GQA and MHA, sinks and window
  alone and together, fp32 and fp16; a captured step's padded metadata; an fp8 cache with
  per-layer scales.
- The decode kernel alone against fp64 attention read straight from the cache, over split
  counts (1, odd, the preloading grids of 8 and 32) and windows narrower than, across and
  wider than its key tiles; empty contexts and -1 padding entries; the split counters reset.
- The prefill kernel alone over windows that end inside a tile, span several tiles, and
  leave whole unmasked tiles between the masked ones.
- Decode with Qwen3's attention input fused in equals the two-launch path with both.
- The tiny gpt-oss model with every attention layer on the Triton backend (chosen by the
  layer, not forced) gives the native backend's logits.

Tolerances: ``triton_reference.tolerance`` on the relative Frobenius error of the whole
output (1e-5 fp32, 2e-3 fp16), as the other attention tests; the model's logits within
1e-4 absolute (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import atom_kernels_triton.attention_backend as triton_backend  # noqa: E402
from atom_kernels_triton import decode_attention, hooks  # noqa: E402
from atom_kernels_triton.attention_backend import TritonAttentionBackend  # noqa: E402
from atom_kernels_triton.decode_attention import NewTokenInput, paged_decode_attention  # noqa: E402
from atom_kernels_triton.prefill_attention import paged_prefill_attention  # noqa: E402
from atom_kernels_triton.qk_norm_rope import qk_norm_rope_cache_write  # noqa: E402
from test_decode_attention_fused_input import fused_case  # noqa: E402
from triton_reference import paged_batch, rel_err, tolerance  # noqa: E402

from atom_core.layers.attention.backend import AttentionInput  # noqa: E402
from atom_core.layers.attention.native import NativeAttentionBackend  # noqa: E402
from atom_core.ops.native.kv_cache import FP8_KV_DTYPE  # noqa: E402
from atom_core.plugins import reset_plugins  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (sinks, window) as a layer may have them; the window crosses the tests' contexts.
VARIANTS = [(True, None), (False, 8), (True, 8), (True, 1)]
VARIANT_IDS = ["sinks", "window", "both", "window-1"]


def sink_logits(heads: int, seed: int = 7, device: str = DEVICE) -> torch.Tensor:
    """Per-head logits large enough to matter against scores of order one."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


def with_extras(backend, sinks, window):
    backend.sinks, backend.sliding_window = sinks, window
    return backend


def backend_case(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype,
                 sinks, window, seed=0, device=DEVICE):
    """TritonAttentionBackend.forward against the native backend's (fp32 math), both with
    the layer's sinks and window; the reference must differ from plain causal attention,
    so neither is a no-op in the case."""
    meta, cache = paged_batch(query_lens, context_lens, block_size, kv_heads, head_dim, dtype,
                              device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n * head_dim, generator=g).to(dtype).to(device)
               for n in (heads, kv_heads, kv_heads))
    s = sink_logits(heads, seed, device) if sinks else None
    scale = head_dim**-0.5

    def native(sinks_, window_):
        b = with_extras(NativeAttentionBackend(heads, head_dim, kv_heads, scale), sinks_, window_)
        return b.forward(q.float(), k.float(), v.float(), cache.clone().float(), meta)

    ref = native(s, window)
    assert rel_err(native(None, None), ref) > 100 * tolerance(dtype), "the case tests nothing"
    tri = with_extras(TritonAttentionBackend(heads, head_dim, kv_heads, scale), s, window)
    out = tri.forward(q, k, v, cache, meta)
    err = rel_err(out, ref)
    assert err < tolerance(dtype), err
    return meta, out, ref


def test_backend_declares_sinks_and_window():
    assert TritonAttentionBackend.supports_sinks and TritonAttentionBackend.supports_sliding_window


# Contexts below, at and past the window; 5 sequences over 2 kv heads on the 8 "SMs" the
# backend assumes on CPU: 4 splits; 2 sequences: 8 splits, the preloading grid.
@pytest.mark.parametrize("sinks,window", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("contexts", [[3, 8, 9, 40, 77], [13, 100]], ids=["4-splits", "8-splits"])
def test_decode(contexts, sinks, window):
    backend_case([1] * len(contexts), contexts, 8, 2, 16, 4, torch.float32, sinks, window)


@pytest.mark.parametrize("sinks,window", VARIANTS, ids=VARIANT_IDS)
def test_mixed_batch_with_chunks_mid_sequence(sinks, window):
    # Decodes, whole prompts shorter and longer than the window, and chunks starting
    # mid-sequence (at 16 and at 50) over cached prefixes.
    backend_case([1, 12, 1, 3, 5, 20], [30, 12, 9, 19, 5, 70], 8, 2, 16, 4, torch.float32,
                 sinks, window)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1)])
def test_mha_and_wide_groups(heads, kv_heads):
    backend_case([1, 9, 1, 6], [50, 9, 3, 27], heads, kv_heads, 16, 8, torch.float32, True, 8)


def test_fp16():
    # 128-query tiles: the prompt spans two; window 40 spans several 32-key tiles.
    backend_case([1, 150, 1, 30], [90, 150, 7, 100], 4, 2, 32, 16, torch.float16, True, 40)


def test_captured_step_metadata_pads_both_kernels():
    """As a step graph runs it: the decode/prefill split on the device, padded with -1, and
    the prefill grid over the padded token count."""
    lens, ctx = [1, 12, 1, 3], [30, 12, 9, 20]
    heads, kv_heads, head_dim = 8, 2, 16
    meta, cache = paged_batch(lens, ctx, 4, kv_heads, head_dim, torch.float32, DEVICE, 0)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), n * head_dim, generator=g).to(DEVICE)
               for n in (heads, kv_heads, kv_heads))
    s = sink_logits(heads)
    nat = with_extras(NativeAttentionBackend(heads, head_dim, kv_heads, 0.25), s, 8)
    ref = nat.forward(q, k, v, cache.clone(), meta)
    meta.decode_seqs = torch.tensor([0, 2, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    meta.prefill_seqs = torch.tensor([3, 1, -1], dtype=torch.int32, device=DEVICE)
    meta.max_query_len = 64
    meta.query_start_loc_cpu = meta.seq_lens_cpu = None  # a captured step has no host facts
    tri = with_extras(TritonAttentionBackend(heads, head_dim, kv_heads, 0.25), s, 8)
    assert rel_err(tri.forward(q, k, v, cache, meta), ref) < tolerance(torch.float32)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.9)])
def test_fp8_cache(k_scale, v_scale):
    """Over an fp8 cache, against the native backend over the same cache and scales. Every
    sequence has a cached prefix: native's fresh prompts attend to the unrounded new K/V,
    not to the cache, so they are not a reference here (test_fp8_kv_cache_triton.py)."""
    lens, ctx = [1, 12, 1, 3, 1], [30, 40, 9, 20, 70]
    heads, kv_heads, head_dim = 8, 2, 16
    meta, cache = paged_batch(lens, ctx, 4, kv_heads, head_dim, torch.float32, DEVICE, 2)
    cache = (cache * 4).to(FP8_KV_DTYPE)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), n * head_dim, generator=g).to(DEVICE)
               for n in (heads, kv_heads, kv_heads))
    s = sink_logits(heads)
    outs = []
    for cls in (TritonAttentionBackend, NativeAttentionBackend):
        b = with_extras(cls(heads, head_dim, kv_heads, head_dim**-0.5), s, 8)
        b.k_scale, b.v_scale = k_scale, v_scale
        outs.append(b.forward(q, 4 * k, v, cache.clone(), meta))
    assert rel_err(*outs) < tolerance(torch.float32)


# --- the decode kernel alone --------------------------------------------------------------


def decode_reference(q, cache, meta, scale, sinks, window):
    """fp64 attention of each sequence's query row over the keys its window holds, read
    straight from the paged cache, each head's sink a softmax column dropped afterwards;
    rows of empty sequences are zero."""
    heads, kv_heads, bs = q.shape[1], cache.shape[3], cache.shape[2]
    flat = cache.double().flatten(1, 2)  # [2, slots, kv_heads, D]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, n in enumerate(meta.seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(0 if window is None else max(n - window, 0), n, device=q.device)
        slots = meta.block_tables[i, pos // bs].long() * bs + pos % bs
        k, v = (flat[j, slots].repeat_interleave(heads // kv_heads, dim=1) for j in (0, 1))
        row = int(meta.query_start_loc[i])
        scores = torch.einsum("hd,nhd->hn", q[row].double(), k) * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks.double()[:, None]), dim=1)
        p = scores.softmax(-1)[:, : len(pos)]
        out[row] = torch.einsum("hn,nhd->hd", p, v)
    return out


def decode_kernel_case(contexts, heads, kv_heads, head_dim, block_size, dtype, num_splits,
                       sinks, window, seq_idx=None, k_scale=1.0, v_scale=1.0, fp8=False):
    """paged_decode_attention over a cache filled everywhere, against decode_reference on
    the entries of seq_idx (all sequences by default; -1 entries are padding, whose rows
    must stay untouched)."""
    meta, cache = paged_batch([1] * len(contexts), [max(n, 1) for n in contexts], block_size,
                              kv_heads, head_dim, dtype, DEVICE, 0)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(cache.shape, generator=g).to(DEVICE)
    cache = (cache * 4).to(FP8_KV_DTYPE) if fp8 else cache.to(dtype)
    meta.seq_lens.copy_(torch.tensor(contexts, dtype=torch.int32))  # 0: a graph's padding row
    q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    s = sink_logits(heads) if sinks else None
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    idx = None if seq_idx is None else torch.tensor(seq_idx, dtype=torch.int32, device=DEVICE)
    paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                           scale, num_splits, seq_idx=idx, k_scale=k_scale, v_scale=v_scale,
                           sinks=s, sliding_window=window)
    read = cache.float()
    read[0] *= k_scale
    read[1] *= v_scale
    ref = decode_reference(q, read, meta, scale, s, window)
    rows = list(range(len(contexts))) if seq_idx is None else [i for i in seq_idx if i >= 0]
    err = rel_err(out[rows], ref[rows])
    assert err < tolerance(dtype), err
    assert all((out[i] == 0).all() for i in rows if contexts[i] == 0), "empty row not zero"
    skipped = [i for i in range(len(contexts)) if i not in rows]
    assert out[skipped].isnan().all()
    for counters in decode_attention._COUNTERS.values():
        assert not counters.any(), "a split counter was left non-zero"


CONTEXTS = [0, 1, 5, 8, 9, 31, 33, 70, 71, 100]


# fp32 key tiles are 32 keys: window 8 lies inside one (and often across two, as the window
# starts anywhere), 70 across three. Contexts of 0 (padding), below, at and past the window.
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 1, 8, 70])
def test_decode_kernel_split_counts(num_splits, window):
    decode_kernel_case(CONTEXTS, 4, 2, 16, 4, torch.float32, num_splits, True, window)


@pytest.mark.slow
def test_decode_kernel_32_splits():
    # The most splits num_kv_splits gives: all but a few leave early (preloading grid), and
    # the merge loops over the partials rather than loading them at once.
    decode_kernel_case(CONTEXTS, 4, 2, 16, 4, torch.float32, 32, True, 70)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kernel_window_without_sinks(num_splits):
    decode_kernel_case([0, 2, 9, 50, 100], 4, 2, 16, 4, torch.float32, num_splits, False, 20)


@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_kernel_padding_entries(num_splits):
    decode_kernel_case([0, 9, 40, 3, 17], 4, 2, 16, 4, torch.float32, num_splits, True, 8,
                       seq_idx=[3, -1, 1, -1, 0])


@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_kernel_fp16(num_splits):
    # 64-key tiles; window 100 spans two of them, at most.
    decode_kernel_case([1, 64, 65, 130, 300], 8, 2, 32, 16, torch.float16, num_splits, True, 100)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_kernel_fp8_cache(num_splits):
    decode_kernel_case([0, 5, 9, 40, 100], 8, 2, 32, 4, torch.float16, num_splits, True, 20,
                       k_scale=0.37, v_scale=2.9, fp8=True)


# --- the prefill kernel alone -------------------------------------------------------------


def prefill_kernel_case(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype,
                        sinks, window, seed=0, tile=None, tma=None):
    """paged_prefill_attention (q_len 1 rows included) against the native backend's
    attention over the same cache (written first), in fp32."""
    meta, cache = paged_batch(query_lens, context_lens, block_size, kv_heads, head_dim, dtype,
                              DEVICE, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n * head_dim, generator=g).to(dtype).to(DEVICE)
               for n in (heads, kv_heads, kv_heads))
    s = sink_logits(heads, seed) if sinks else None
    nat = with_extras(NativeAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5), s, window)
    ref_cache = cache.clone().float()
    ref = nat.forward(q.float(), k.float(), v.float(), ref_cache, meta).view(t, heads, head_dim)
    out = torch.full((t, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    seqs = torch.arange(len(query_lens), dtype=torch.int32, device=DEVICE)
    paged_prefill_attention(q.view(t, heads, head_dim), ref_cache.to(dtype), meta.block_tables,
                            meta.seq_lens, meta.query_start_loc, seqs, max(query_lens), out,
                            head_dim**-0.5, sinks=s, sliding_window=window, tile=tile,
                            tma=tma)
    err = rel_err(out, ref)
    assert err < tolerance(dtype), err


# fp32 tiles: 32 queries x 32 keys. Window 5 ends inside a key tile, 40 spans two, 100
# leaves whole unmasked tiles between the first row's window start and the diagonal.
# Sequences: a fresh prompt over several query tiles, a decode row, a chunk starting at
# 163 (mid-tile), a 1-token prompt, a fresh prompt ending mid-tile.
@pytest.mark.parametrize("window", [1, 5, 40, 100, None])
@pytest.mark.parametrize("block_size", [4, 32])
def test_prefill_kernel_windows_and_tile_edges(window, block_size):
    prefill_kernel_case([75, 1, 40, 1, 70], [75, 90, 203, 1, 70], 2, 1, 32, block_size,
                        torch.float32, True, window)


def test_prefill_kernel_window_without_sinks():
    prefill_kernel_case([75, 40], [75, 203], 2, 1, 16, 16, torch.float32, False, 40)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_kernel_gqa(group):
    prefill_kernel_case([37, 1, 66], [100, 9, 66], group, 1, 16, 16, torch.float32, True, 20)


# fp16 tiles: 128 queries x 32 keys. 200 > 128 + 32: the chunk at 163 has unmasked tiles.
@pytest.mark.parametrize("window", [40, 200])
def test_prefill_kernel_fp16(window):
    prefill_kernel_case([150, 40, 1], [150, 203, 80], 2, 1, 32, 16, torch.float16, True, window)


# The small grids' 64 x 64 tiles (a step's prompt chunks on a GPU): windows inside a key
# tile and past several, the chunk at 163 starting mid-tile.
@pytest.mark.parametrize("window", [5, 40, 200])
def test_prefill_kernel_small_grid_tiles(window):
    prefill_kernel_case([150, 40, 1], [150, 203, 80], 2, 1, 32, 16, torch.float16, True, window,
                        tile=(64, 64, 4, 3))


# TMA tiles (64 keys inside a page of 64, by descriptor): windows inside a key tile, across
# several, and none; the chunk at 163 starts mid-tile and mid-page.
@pytest.mark.parametrize("window", [5, 40, 200, None])
def test_prefill_kernel_tma_tiles(window):
    prefill_kernel_case([150, 40, 1], [150, 203, 80], 2, 1, 32, 64, torch.float16, True, window,
                        tile=(128, 64, 4, 3), tma=True)


# --- decode with Qwen3's attention input fused in -----------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_fused_input_equals_the_two_launch_path(num_splits):
    contexts, heads, kv_heads, head_dim = [0, 1, 5, 33, 70, 2], 8, 2, 32
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case(contexts, heads, kv_heads, head_dim,
                                                            head_dim, torch.float32)
    s, window, shape = sink_logits(heads), 20, (len(contexts), heads, head_dim)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    extras = {"sinks": s, "sliding_window": window}
    ref_cache = cache.clone()
    q_in, _ = qk_norm_rope_cache_write(q, k, v, qw, kw, 1e-6, pos, cos_sin, ref_cache,
                                       meta.slot_mapping, True)
    ref = torch.full(shape, float("nan"), device=DEVICE)
    paged_decode_attention(q_in.view(shape), ref_cache, *args, ref, head_dim**-0.5, num_splits,
                           **extras)
    out = torch.full_like(ref, float("nan"))
    new = NewTokenInput(k, v, qw, kw, 1e-6, pos, cos_sin, meta.slot_mapping, True)
    paged_decode_attention(q.view(shape), cache, *args, out, head_dim**-0.5, num_splits,
                           new_tokens=new, **extras)
    live = [i for i, n in enumerate(contexts) if n]
    assert rel_err(out[live], ref[live]) < tolerance(torch.float32)
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())
    # And the backend's forward_input takes that fused launch, matching native's.
    meta.seq_lens_cpu = list(contexts)
    inp = AttentionInput(pos, cos_sin, True, qw, kw, 1e-6)
    nat = with_extras(NativeAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5), s, window)
    tri = with_extras(TritonAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5), s, window)
    got = tri.forward_input(q, k, v, cache.clone(), meta, inp).view(shape)
    want = nat.forward_input(q, k, v, cache.clone(), meta, inp).view(shape)
    assert rel_err(got[live], want[live]) < tolerance(torch.float32)


def test_backend_forward_input_fuses_with_sinks_and_window(monkeypatch):
    launches = []
    attend = triton_backend.paged_decode_attention
    monkeypatch.setattr(triton_backend, "paged_decode_attention",
                        lambda *a, **kw: launches.append(kw) or attend(*a, **kw))
    contexts, heads, kv_heads, head_dim = [9, 40, 3, 70], 8, 2, 16
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case(contexts, heads, kv_heads, head_dim,
                                                            head_dim, torch.float32)
    meta.seq_lens_cpu = list(contexts)
    s = sink_logits(heads)
    inp = AttentionInput(pos, cos_sin, True, qw, kw, 1e-6)
    tri = with_extras(TritonAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5), s, 8)
    nat = with_extras(NativeAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5), s, 8)
    out = tri.forward_input(q, k, v, cache.clone(), meta, inp)
    ref = nat.forward_input(q, k, v, cache.clone(), meta, inp)
    assert rel_err(out, ref) < tolerance(torch.float32)
    assert len(launches) == 1 and launches[0]["new_tokens"] is not None
    assert launches[0]["sinks"] is s and launches[0]["sliding_window"] == 8


# --- the tiny gpt-oss model ---------------------------------------------------------------

_GPTOSS_TESTS = Path(__file__).resolve().parents[2] / "atom-models-gptoss" / "tests"


@pytest.fixture
def triton_attention_on_cpu(monkeypatch):
    """Register the Triton attention backend for the CPU (the interpreter runs it), and no
    Triton op: every other op stays the core's."""
    monkeypatch.setattr(hooks, "unavailable_reason", lambda: None)
    monkeypatch.setattr(hooks, "DEVICE_KINDS", ("cpu", "cuda", "hip"))
    monkeypatch.setattr(hooks, "triton_ops", lambda: {})
    reset_plugins()
    yield
    reset_plugins()


@pytest.mark.slow
def test_tiny_gptoss_logits_equal_native(triton_attention_on_cpu, monkeypatch):
    pytest.importorskip("atom_models_gptoss")
    pytest.importorskip("transformers")
    if not (_GPTOSS_TESTS / "tiny_gptoss.py").exists():
        pytest.skip("the gpt-oss plugin's tests (tiny_gptoss.py) are not in this checkout")
    monkeypatch.syspath_prepend(str(_GPTOSS_TESTS))
    from tiny_gptoss import SLIDING_WINDOW, tiny_dir

    from atom_core.config import Config
    from atom_core.layers.context import forward_context
    from atom_core.loader import load_model
    from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches

    def run(backend_kind: str) -> list[torch.Tensor]:
        model = load_model(Config.from_kwargs(model=str(tiny_dir("bf16"))), "cpu",
                           torch.float32).model
        names = {layer.self_attn.attn.backend_name for layer in model.model.layers}
        assert names == {backend_kind}
        kv = PagedKV(num_blocks=64, block_size=4, seed=1)
        allocate_kv_caches(model, kv)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 272, (n,), generator=g).tolist() for n in (5, 19, 3, 14)]
        ids = [kv.add_sequence() for _ in prompts]
        # Whole prompts (one past the window) and a first chunk; decodes and the chunk
        # starting mid-sequence; then decodes only, over contexts past twice the window.
        steps = [[*prompts[:3], prompts[3][:6]], [[7], [8], [9], prompts[3][6:]]]
        steps += [[[10], [11], [12], [13]]] * 3
        logits = []
        for new in steps:
            meta, positions = kv.step(ids, [len(t) for t in new])
            flat = torch.tensor([t for chunk in new for t in chunk])
            with torch.no_grad(), forward_context(meta):
                logits.append(model.compute_logits(model(flat, positions)))
        assert 19 + 3 > 2 * SLIDING_WINDOW
        return logits

    tri = run("triton")
    monkeypatch.undo()  # the registry as it is on CPU: native only
    reset_plugins()
    nat = run("native")
    for step, (a, b) in enumerate(zip(tri, nat)):
        assert (a - b).abs().max().item() < 1e-4, step
