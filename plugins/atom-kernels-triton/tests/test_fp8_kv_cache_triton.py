"""The Triton attention backends over a float8_e4m3fn KV cache (``--kv_cache_dtype fp8``),
CPU through TRITON_INTERPRET=1 on small shapes, with scales of one and with per-layer K/V
scales (and MLA's latent scale) that are not powers of two, so that ``e4m3(x / s) * s``
differs from ``e4m3(x)``.

Writes (the K/V write, the fused q/k norm + RoPE write, the MLA latent write) store exactly
the bytes the native ``store_rows`` stores with the same scales: every finite bf16 and fp16
value, e4m3's rounding ties, and values past +-448, which saturate. Reads: decode (split
and unsplit, the preloading grid), prefill, extend and mixed batches, decode with Qwen3's
attention input fused in, and MLA decode equal attention over the dequantized cache
(stored values times their scales), and the native backend over the same fp8 cache on
every row (both read a prompt's own K/V back from the cache). Compute dtypes
fp32 and fp16: the interpreter's tl.dot reads bf16 operands as raw bits (tests/gpu covers
bf16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atom_kernels_triton.attention_backend as triton_backend  # noqa: E402
from atom_kernels_triton.attention_backend import TritonAttentionBackend  # noqa: E402
from atom_kernels_triton.decode_attention import NewTokenInput, paged_decode_attention  # noqa: E402
from atom_kernels_triton.kv_cache import write_kv_cache  # noqa: E402
from atom_kernels_triton.mla_backend import TritonMLABackend  # noqa: E402
from atom_kernels_triton.mla_decode import mla_decode_attention, write_latent_cache  # noqa: E402
from atom_kernels_triton.qk_norm_rope import qk_norm_rope_cache_write  # noqa: E402
from test_decode_attention_fused_input import fused_case  # noqa: E402
from test_mla_decode_triton import DIMS, Batch, latent_batch, reference_decode  # noqa: E402
from test_triton_attention import check_decode, decode_inputs, decode_reference  # noqa: E402
from triton_reference import native_attention, paged_batch, rel_err, tolerance  # noqa: E402

from atom_core.layers.attention.backend import AttentionInput  # noqa: E402
from atom_core.layers.attention.metadata import AttentionMetadata  # noqa: E402
from atom_core.layers.attention.mla_native import NativeMLABackend  # noqa: E402
from atom_core.layers.attention.native import NativeAttentionBackend  # noqa: E402
from atom_core.ops.native.kv_cache import FP8_KV_DTYPE, store_rows  # noqa: E402
from atom_core.ops.native.kv_cache import write_kv_cache as native_write  # noqa: E402
from atom_core.ops.native.qk_norm_rope import qk_norm_rope_cache_write as native_fused  # noqa: E402
from atom_core.testing.op_cases import qk_norm_rope_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = FP8_KV_DTYPE
# Per-layer scales that are not powers of two (a power of two only shifts the exponent).
K_SCALE, V_SCALE = 0.37, 2.9


def stored(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as an fp8 cache holds it under ``scale``, read back (times the scale) in x's dtype:
    store_rows' rounding of x times the fp32 reciprocal."""
    held = (x.float() * torch.tensor(1 / scale)).clamp(-448, 448).to(FP8)
    return (held.float() * scale).to(x.dtype)


def dequantized(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """An fp8 [2, ...] K/V cache as attention reads it: fp32, K and V times their scales."""
    out = cache.float()
    out[0] *= k_scale
    out[1] *= v_scale
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype == FP8
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def e4m3_edges() -> torch.Tensor:
    """fp32 values where rounding to e4m3 can go wrong: every midpoint between neighbouring
    e4m3 values (ties, subnormal ones included) and a hair either side of it, values past
    448 (which saturate), infinities and signed zeros."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique().sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat((mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e4))))
    big = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e4, 3e38, float("inf"), 0.0, 1e-30])
    pos = torch.cat((near, big))
    return torch.cat((pos, -pos))


def random_slots(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    """Distinct slots in shuffled order, every fifth token padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[::5] = -1
    return slots.to(DEVICE)


# --- writes -------------------------------------------------------------------------------


def every_finite(dtype: torch.dtype) -> torch.Tensor:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return bits[bits.isfinite()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_write_stores_what_store_rows_stores(dtype):
    values = every_finite(dtype) if dtype != torch.float32 else torch.cat(
        (e4m3_edges(), torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 50))
    kv_heads, head_dim = 2, 64
    width = kv_heads * head_dim
    values = torch.cat((values, values[: -len(values) % width])).to(DEVICE)
    k = values.view(-1, width)
    v = -k.flip(0)
    tokens = k.shape[0]
    blocks = tokens // 8 + 5
    slots = random_slots(tokens, blocks * 8, seed=1)
    cache = torch.full((2, blocks, 8, kv_heads, head_dim), float("nan"), device=DEVICE)
    cache = cache.to(FP8)
    ref = cache.clone()
    write_kv_cache(k, v, cache, slots)
    native_write(k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim), ref,
                 slots)
    assert same_bytes(cache, ref)  # padding rows (slot -1) left their slots' NaN too


def check_fused_write(q, k, v, qw, kw, pos, cos_sin, cache, slots, is_neox, dtype,
                      k_scale=1.0, v_scale=1.0):
    """qk_norm_rope_cache_write into the fp8 ``cache`` with the given scales: store_rows'
    bytes of the k it returns and of v, and within k's own rounding what the native op
    returns and stores."""
    kv_heads, head_dim = cache.shape[-2:]
    before, ref_cache = cache.clone(), cache.clone()
    ref_q, ref_k = native_fused(q, k, v, qw, kw, 1e-6, pos, cos_sin, ref_cache, slots, is_neox,
                                k_scale, v_scale)
    got_q, got_k = qk_norm_rope_cache_write(q, k, v, qw, kw, 1e-6, pos, cos_sin, cache, slots,
                                            is_neox, k_scale, v_scale)
    assert rel_err(got_q, ref_q) < tolerance(dtype)
    assert rel_err(got_k, ref_k) < tolerance(dtype)
    flat = before.view(2, -1, kv_heads, head_dim)
    store_rows(flat[0], slots, got_k.reshape(-1, kv_heads, head_dim), k_scale)
    store_rows(flat[1], slots, v.reshape(-1, kv_heads, head_dim), v_scale)
    assert same_bytes(cache, before)  # padding rows (slot -1) stored nothing
    got, ref = (dequantized(c, k_scale, v_scale).nan_to_num() for c in (cache, ref_cache))
    assert rel_err(got, ref) < tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("is_neox", [True, False])
def test_fused_qk_norm_rope_write_saturates_as_native(dtype, is_neox):
    q, k, v, qw, kw, pos, cos_sin, cache, slots = qk_norm_rope_case(
        dtype, 4, 2, 32, 32, device=DEVICE)
    v.mul_(300)  # v is not normed: some values pass 448 and must saturate
    assert v.abs().max() > 448
    check_fused_write(q, k, v, qw, kw, pos, cos_sin, cache.to(FP8), slots, is_neox, dtype)


# e4m3_edges' 3e38 over 0.37 overflows fp32 to inf in the interpreter's numpy: saturated as
# inf is.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_scaled_writes_store_what_store_rows_stores():
    """The K/V write, the fused q/k norm + RoPE write and the latent write with per-layer
    scales: the native bytes with the same scales (and not the unscaled ones)."""
    values = torch.cat((e4m3_edges(), torch.randn(4000, generator=torch.Generator()
                                                  .manual_seed(3)) * 300))
    kv_heads, head_dim = 2, 32
    width = kv_heads * head_dim
    values = torch.cat((values, values[: -len(values) % width])).to(DEVICE)
    k = values.view(-1, width)
    v = -k.flip(0)
    tokens = k.shape[0]
    blocks = tokens // 8 + 5
    slots = random_slots(tokens, blocks * 8, seed=4)
    cache = torch.full((2, blocks, 8, kv_heads, head_dim), float("nan"), device=DEVICE).to(FP8)
    ref, unscaled = cache.clone(), cache.clone()
    write_kv_cache(k, v, cache, slots, K_SCALE, V_SCALE)
    shaped = (tokens, kv_heads, head_dim)
    native_write(k.view(shaped), v.view(shaped), ref, slots, K_SCALE, V_SCALE)
    assert same_bytes(cache, ref)
    write_kv_cache(k, v, unscaled, slots)
    assert not same_bytes(cache, unscaled)

    q, k, v, qw, kw, pos, cos_sin, cache, slots = qk_norm_rope_case(
        torch.float16, 4, 2, 32, 32, device=DEVICE)
    v.mul_(900)  # past 448 * V_SCALE in places
    assert v.abs().max() > 448 * V_SCALE
    check_fused_write(q, k, v, qw, kw, pos, cos_sin, cache.to(FP8), slots, True, torch.float16,
                      K_SCALE, V_SCALE)

    rows = torch.randn(40, 48 + 16, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 50
    slots = random_slots(40, 64, seed=6)
    cache = torch.full((4, 16, 64), float("nan"), device=DEVICE).to(FP8)
    ref = cache.clone()
    write_latent_cache(rows[:, :48], rows[:, 48:], cache, slots, K_SCALE)
    NativeMLABackend.write_cache(rows[:, :48], rows[:, 48:], ref, slots, K_SCALE)
    assert same_bytes(cache, ref)


def test_latent_write_stores_what_store_rows_stores():
    rank, rope = 48, 16
    values = torch.cat((e4m3_edges(), torch.randn(4000) * 100))
    values = torch.cat((values, values[: -len(values) % (rank + rope)])).to(DEVICE)
    rows = values.view(-1, rank + rope)
    tokens = rows.shape[0]
    blocks = tokens // 16 + 2
    slots = random_slots(tokens, blocks * 16, seed=2)
    cache = torch.full((blocks, 16, rank + rope), float("nan"), device=DEVICE)
    cache = cache.to(FP8)
    ref = cache.clone()
    write_latent_cache(rows[:, :rank], rows[:, rank:], cache, slots)
    NativeMLABackend.write_cache(rows[:, :rank], rows[:, rank:], ref, slots)
    assert same_bytes(cache, ref)


# --- MHA/GQA reads ------------------------------------------------------------------------


def fp8_decode_inputs(context_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """decode_inputs' batch over an fp8 cache whose values span e4m3's normal range."""
    q, cache, meta = decode_inputs(context_lens, heads, kv_heads, head_dim, block_size,
                                   torch.float32, seed)
    cache = (cache * 4).to(FP8)
    return q.to(dtype), cache, meta


def native_decode(q, cache, meta, rows, k_scale=1.0, v_scale=1.0):
    """The native backend's decode of the given rows (one query per sequence) over the same
    cache, nothing written."""
    n, heads, head_dim = len(rows), q.shape[1], q.shape[2]
    lens = meta.seq_lens[rows]
    sub = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, device=DEVICE),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=lens, block_tables=meta.block_tables[rows], block_size=cache.shape[2],
        max_query_len=1, max_seq_len=int(lens.max()), query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=lens.tolist(),
    )
    backend = NativeAttentionBackend(heads, head_dim, cache.shape[3], head_dim**-0.5)
    backend.k_scale, backend.v_scale = k_scale, v_scale
    kv = q.new_zeros(n, cache.shape[3] * head_dim)
    out = backend.forward(q[rows].reshape(n, -1), kv, kv, cache, sub, cache_written=True)
    return out.view(n, heads, head_dim)


# Split counts: one, odd, 8 (the first tile loaded before the PDL wait).
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_over_fp8_cache(num_splits, dtype):
    q, cache, meta = fp8_decode_inputs([0, 1, 5, 31, 33, 100, 2], 8, 2, 32, 4, dtype)
    # Against fp64 attention over the dequantized cache (check_decode's reference reads the
    # cache through .double()); empty contexts are zero, split counters reset.
    out = check_decode(q, cache, meta, num_splits)
    # Against the native backend over the same cache.
    rows = (meta.seq_lens > 0).nonzero().flatten()
    assert rel_err(out[rows], native_decode(q, cache, meta, rows)) < tolerance(dtype)


@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_over_scaled_fp8_cache(num_splits):
    q, cache, meta = fp8_decode_inputs([0, 1, 5, 31, 33, 100, 2], 8, 2, 32, 4, torch.float16)
    out = torch.full_like(q, float("nan"))
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    paged_decode_attention(q, cache, *args, out, 32**-0.5, num_splits, k_scale=K_SCALE,
                           v_scale=V_SCALE)
    ref = decode_reference(q, dequantized(cache, K_SCALE, V_SCALE), *args, 32**-0.5)
    rows = (meta.seq_lens > 0).nonzero().flatten()
    assert rel_err(out[rows], ref[rows]) < tolerance(torch.float16)
    assert (out[meta.seq_lens == 0] == 0).all()
    native = native_decode(q, cache, meta, rows, K_SCALE, V_SCALE)
    assert rel_err(out[rows], native) < tolerance(torch.float16)


def backend_case(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype,
                 seed=0, k_scale=1.0, v_scale=1.0):
    """TritonAttentionBackend.forward (write, then decode/prefill kernels) over an fp8 cache
    with the given scales against attention over the dequantized cache and against the
    native backend."""
    meta, cache = paged_batch(query_lens, context_lens, block_size, kv_heads, head_dim,
                              torch.float32, DEVICE, seed)
    cache = (cache * 4).to(FP8)  # the cached prefix; the new tokens' slots hold NaN
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n * head_dim, generator=g).to(DEVICE) for n in
               (heads, kv_heads, kv_heads))
    v[::3] *= 200  # some values pass 448 and must saturate
    q, k, v = q.to(dtype), (4 * k).to(dtype), v.to(dtype)
    tri_backend = TritonAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    nat_backend = NativeAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    for b in (tri_backend, nat_backend):
        b.k_scale, b.v_scale = k_scale, v_scale
    out = tri_backend.forward(q, k, v, tri := cache.clone(), meta)
    # The write: native's bytes, everywhere (padding and untouched slots keep their NaN).
    nat = nat_backend.forward(q, k, v, nat_cache := cache.clone(), meta)
    assert same_bytes(tri, nat_cache)
    # Attention over the dequantized cache: native in fp32 over a float copy, the new
    # tokens' K/V as the cache holds them.
    ref, ref_cache = native_attention(
        q, stored(k.float(), k_scale), stored(v.float(), v_scale),
        dequantized(cache, k_scale, v_scale), meta, heads, kv_heads, head_dim)
    assert torch.equal(dequantized(tri, k_scale, v_scale).nan_to_num(), ref_cache.nan_to_num())
    assert rel_err(out, ref) < tolerance(dtype)
    # The native backend over the same fp8 cache: decodes, extends and whole prompts.
    assert rel_err(out, nat) < tolerance(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_decode(dtype):
    backend_case([1, 1, 1], [1, 40, 77], 8, 2, 32, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_prefill(dtype):
    # fp16 prefill tiles are 128 queries: the first prompt spans two.
    backend_case([150, 7], [150, 7], 4, 2, 32, 8, dtype)


def test_backend_extend_over_cached_prefix():
    backend_case([5, 33], [21, 70], 4, 4, 32, 16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_mixed_batch(dtype):
    backend_case([1, 12, 1, 3, 20], [30, 12, 9, 20, 20], 8, 2, 16, 4, dtype)


def test_prefill_head_dim_64_fp16():
    # Unmasked full tiles (no head-dim padding) take the plain-load branch.
    backend_case([70, 1], [200, 50], 4, 1, 64, 16, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_mixed_batch_with_scales(dtype):
    # Decodes, a whole prompt, extends: the write, the decode and the prefill kernel.
    backend_case([1, 12, 1, 3, 20], [30, 12, 9, 20, 20], 8, 2, 16, 4, dtype,
                 k_scale=K_SCALE, v_scale=V_SCALE)


# --- decode with Qwen3's attention input fused in -----------------------------------------


def fused_decode_case(contexts, heads, kv_heads, head_dim, rot_dim, dtype, num_splits,
                      is_neox=True, block_size=4, k_scale=1.0, v_scale=1.0):
    """Decode with the attention input fused in stores the new row saturated and attends to
    it as stored: the two-launch path (the fused write, then decode over the cache) - bit
    for bit under the interpreter; on a GPU the two kernels may contract the fp32 RoPE
    differently, so within rounding - which is attention over the dequantized cache."""
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case(contexts, heads, kv_heads,
                                                            head_dim, rot_dim, dtype, block_size)
    v.mul_(300)  # past 448 in places: the row attended to must be the saturated one
    cache = (cache.float() * 4).to(FP8)
    scale = head_dim**-0.5
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    ref_cache = cache.clone()
    q_in, _ = qk_norm_rope_cache_write(q, k, v, qw, kw, 1e-6, pos, cos_sin, ref_cache,
                                       meta.slot_mapping, is_neox, k_scale, v_scale)
    shape = (len(contexts), heads, head_dim)
    ref = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    paged_decode_attention(q_in.view(shape), ref_cache, *args, ref, scale, num_splits, **scales)
    out = torch.full_like(ref, float("nan"))
    new = NewTokenInput(k, v, qw, kw, 1e-6, pos, cos_sin, meta.slot_mapping, is_neox)
    paged_decode_attention(q.view(shape), cache, *args, out, scale, num_splits, new_tokens=new,
                           **scales)
    live = meta.seq_lens > 0
    if DEVICE == "cpu":
        assert same_bytes(cache, ref_cache)
        assert torch.equal(out, ref)
    else:
        assert torch.equal(cache.float().isnan(), ref_cache.float().isnan())
        assert rel_err(cache.float().nan_to_num(), ref_cache.float().nan_to_num()) < tolerance(
            dtype)
        for row in live.nonzero().flatten().tolist():
            assert rel_err(out[row], ref[row]) < tolerance(dtype), row
    # fp64 attention over the dequantized cache.
    exact = decode_reference(q_in.view(shape), dequantized(ref_cache, k_scale, v_scale), *args,
                             scale)
    assert rel_err(out[live], exact[live]) < tolerance(dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,rot_dim,is_neox", [
    (torch.float32, 8, 2, 32, 32, True),
    (torch.float16, 8, 2, 32, 32, True),
    (torch.float32, 6, 2, 24, 24, False),  # GPT-J pairs, non-power-of-two head
])
def test_fused_input_over_fp8_cache(num_splits, dtype, heads, kv_heads, head_dim, rot_dim,
                                    is_neox):
    fused_decode_case([0, 1, 5, 33, 70, 2], heads, kv_heads, head_dim, rot_dim, dtype,
                      num_splits, is_neox)


@pytest.mark.parametrize("num_splits", [1, 8])
def test_fused_input_over_scaled_fp8_cache(num_splits):
    fused_decode_case([0, 1, 5, 33, 70, 2], 8, 2, 32, 32, torch.float16, num_splits,
                      k_scale=K_SCALE, v_scale=V_SCALE)


def forward_input_case(contexts, heads, kv_heads, head_dim, dtype, monkeypatch, block_size=4,
                       k_scale=1.0, v_scale=1.0):
    """Qwen3's decode step as the Triton backend runs it over few splits (one launch with
    the attention input fused in) against the native backend's forward_input (the fused
    op, then SDPA) over the same fp8 cache."""
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case(contexts, heads, kv_heads,
                                                            head_dim, head_dim, dtype, block_size)
    meta.seq_lens_cpu = list(contexts)
    cache = (cache.float() * 4).to(FP8)
    inp = AttentionInput(pos, cos_sin, True, qw, kw, 1e-6)
    launches = []
    attend = triton_backend.paged_decode_attention
    monkeypatch.setattr(triton_backend, "paged_decode_attention",
                        lambda *a, **kw: launches.append(kw.get("new_tokens") is not None)
                        or attend(*a, **kw))
    tri_backend = TritonAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    nat_backend = NativeAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    for b in (tri_backend, nat_backend):
        b.k_scale, b.v_scale = k_scale, v_scale
    out = tri_backend.forward_input(q, k, v, tri := cache.clone(), meta, inp)
    assert launches == [True]
    ref = nat_backend.forward_input(q, k, v, nat := cache.clone(), meta, inp)
    assert rel_err(out, ref) < tolerance(dtype)
    # The k each computed may differ in its last bit, and its rounding to e4m3 with it.
    assert torch.equal(tri.float().isnan(), nat.float().isnan())
    assert rel_err(tri.float().nan_to_num(), nat.float().nan_to_num()) < tolerance(dtype)


def test_backend_forward_input_fuses_over_fp8_cache(monkeypatch):
    # 4 sequences x 2 kv heads on the 8 "SMs" the backend assumes on CPU: 4 splits, fused.
    forward_input_case([9, 40, 3, 70], 8, 2, 32, torch.float32, monkeypatch)
    forward_input_case([9, 40, 3, 70], 8, 2, 32, torch.float32, monkeypatch, k_scale=K_SCALE,
                       v_scale=V_SCALE)


# --- MLA ----------------------------------------------------------------------------------


def mla_kernel_case(seq_lens, heads, rank, rope, block_size, dtype, splits, seed=4,
                    kv_scale=1.0):
    """mla_decode_attention over an fp8 latent cache against fp64 softmax over its
    dequantized latents (times ``kv_scale``); an empty context yields zeros."""
    cache, tables, lens = latent_batch(seq_lens, block_size, rank, rope, torch.float32, seed)
    cache = (cache * 4).to(FP8)
    g = torch.Generator().manual_seed(seed + 1)
    q_latent = torch.randn(len(seq_lens), heads, rank, generator=g).to(dtype).to(DEVICE)
    q_pe = torch.randn(len(seq_lens), heads, rope, generator=g).to(dtype).to(DEVICE)
    scale = (rank + rope) ** -0.5
    out = mla_decode_attention(q_latent, q_pe, cache, tables, lens, scale, splits,
                               kv_scale=kv_scale)
    assert out.dtype == dtype
    ref = reference_decode(q_latent, q_pe, cache.float() * kv_scale, tables, lens, scale)
    assert rel_err(out, ref) < tolerance(dtype)
    for s, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_kernel_over_fp8_cache(splits, dtype):
    mla_kernel_case([0, 1, 17, 70, 33], 4, 32, 16, 16, dtype, splits)


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_kernel_over_scaled_fp8_cache(splits):
    mla_kernel_case([0, 1, 17, 70, 33], 4, 32, 16, 16, torch.float16, splits, kv_scale=K_SCALE)


def mla_backend_case(cached, new, block_size, dtype, dims=DIMS, tol=1.0, kv_scale=1.0):
    """TritonMLABackend against NativeMLABackend over the same fp8 latent cache, both with
    ``kv_scale``: the same bytes written (new latents past 448 * kv_scale saturate) and
    outputs within ``tol`` tolerances."""
    batch = Batch(cached, new, block_size, dtype=dtype, seed=6, dims=dims, device=DEVICE)
    batch.cache = (batch.cache.float() * 4).to(FP8)
    batch.inputs[2][::2] *= 200  # kv_c of every other new token

    def run(cls):
        backend = batch.backend(cls)
        backend.kv_scale = kv_scale
        cache = batch.cache.clone()
        return backend.forward(*batch.inputs, cache, batch.meta), cache

    out, cache = run(TritonMLABackend)
    ref, ref_cache = run(NativeMLABackend)
    assert same_bytes(cache, ref_cache)
    assert out.dtype == dtype
    assert rel_err(out, ref) < tol * tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "cached,new",
    [([4, 36, 0, 17, 63], [1] * 5), ([0, 16, 4, 36, 3], [10, 7, 1, 1, 5])],
    ids=["decode", "mixed"],
)
def test_mla_backend_matches_native_over_fp8_cache(dtype, cached, new):
    mla_backend_case(cached, new, 16, dtype)


@pytest.mark.parametrize(
    "cached,new",
    [([4, 36, 0, 17, 63], [1] * 5), ([0, 16, 4, 36, 3], [10, 7, 1, 1, 5])],
    ids=["decode", "mixed"],
)
def test_mla_backend_matches_native_over_scaled_fp8_cache(cached, new):
    mla_backend_case(cached, new, 16, torch.float16, kv_scale=K_SCALE)


def test_backends_declare_an_fp8_cache():
    assert TritonAttentionBackend.fp8_kv_cache and TritonMLABackend.fp8_kv_cache
