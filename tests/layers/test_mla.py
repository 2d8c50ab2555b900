"""The native MLA backend: mixed paged batches against expanded-K/V attention, absorbed
decode against non-absorbed prefill on the same latent cache, and the layer's contract."""

import pytest
import torch

from atom_core.layers.attention.mla import MLAAttention
from atom_core.layers.attention.mla_native import NativeMLABackend
from atom_core.layers.context import BuildContext, build_context, forward_context
from atom_core.plugins import get_registries
from atom_core.testing.paged_kv import PagedKV

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 24
SCALE = (NOPE + ROPE) ** -0.5


def make_backend():
    return NativeMLABackend(HEADS, NOPE, ROPE, V, RANK, SCALE)


def dense_reference(q_nope, q_pe, kv_c, k_pe, w_kv_b):
    """The last Lq of the L tokens, the way transformers computes MLA: expand every latent
    into per-head K/V, causal attention, fp64."""
    query_len, length = q_nope.shape[0], kv_c.shape[0]
    kv = (kv_c.double() @ w_kv_b.double().T).view(length, HEADS, NOPE + V)
    k = torch.cat((kv[..., :NOPE], k_pe.double()[:, None].expand(length, HEADS, ROPE)), -1)
    q = torch.cat((q_nope, q_pe), -1).double()
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    visible = torch.ones(query_len, length, dtype=torch.bool).tril(length - query_len)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, kv[..., NOPE:])


class Sequences:
    """Random latents and queries for sequences over a NaN-filled paged latent cache."""

    def __init__(self, lengths, block_size, seed=0, dtype=torch.float32):
        self.g = torch.Generator().manual_seed(seed)
        self.kv = PagedKV(num_blocks=64, block_size=block_size, seed=seed + 1)
        self.backend = make_backend()
        shape = self.backend.kv_cache_shape(64, block_size, RANK, ROPE)
        self.cache = torch.full(shape, float("nan"), dtype=dtype)
        self.w = torch.randn(HEADS * (NOPE + V), RANK, generator=self.g) / RANK**0.5
        self.kv_c = [torch.randn(n, RANK, generator=self.g) for n in lengths]
        self.k_pe = [torch.randn(n, ROPE, generator=self.g) for n in lengths]
        self.q_nope = [torch.randn(n, HEADS, NOPE, generator=self.g) for n in lengths]
        self.q_pe = [torch.randn(n, HEADS, ROPE, generator=self.g) for n in lengths]
        self.ids = [self.kv.add_sequence() for _ in lengths]

    def step(self, seqs, spans):
        """Compute tokens spans[i] = (start, end) of sequence seqs[i] in one batch."""
        meta, _ = self.kv.step([self.ids[s] for s in seqs], [b - a for a, b in spans])

        def cat(parts):
            return torch.cat([parts[s][a:b] for s, (a, b) in zip(seqs, spans)])

        out = self.backend.forward(
            cat(self.q_nope), cat(self.q_pe), cat(self.kv_c), cat(self.k_pe), self.w, self.cache,
            meta,
        )
        assert out.shape == (sum(b - a for a, b in spans), HEADS * V)
        return out.view(-1, HEADS, V).split([b - a for a, b in spans])

    def reference(self, s, start, end):
        return dense_reference(
            self.q_nope[s][start:end], self.q_pe[s][start:end], self.kv_c[s][:end],
            self.k_pe[s][:end], self.w,
        )


# (context already cached, tokens this step) per sequence
MIXED = [(0, 10), (16, 7), (4, 1), (36, 1), (0, 1), (3, 5), (0, 2)]
DECODES = [(4, 1), (36, 1), (0, 1), (17, 1), (8, 1)]
PREFILLS = [(0, 9), (13, 3), (5, 20)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", [MIXED, DECODES, PREFILLS], ids=["mixed", "decode", "prefill"])
def test_native_mla_matches_expanded_attention(block_size, batch):
    seqs = Sequences([p + n for p, n in batch], block_size, seed=block_size)
    cached = [(s, p) for s, (p, _) in enumerate(batch) if p]
    if cached:
        seqs.step([s for s, _ in cached], [(0, p) for _, p in cached])
    data_ptr = seqs.cache.data_ptr()
    outs = seqs.step(list(range(len(batch))), [(p, p + n) for p, n in batch])
    assert seqs.cache.data_ptr() == data_ptr
    for s, ((p, n), got) in enumerate(zip(batch, outs)):
        torch.testing.assert_close(got.double(), seqs.reference(s, p, p + n), atol=1e-5, rtol=1e-5)
    # Every token's latent is in the cache at its slot, [kv_c | k_pe].
    for s, sid in enumerate(seqs.ids):
        for pos in range(seqs.kv.lens[sid]):
            block = seqs.kv.tables[sid][pos // block_size]
            want = torch.cat((seqs.kv_c[s][pos], seqs.k_pe[s][pos]))
            torch.testing.assert_close(seqs.cache[block, pos % block_size], want)


@pytest.mark.parametrize("block_size", [4, 16])
def test_absorbed_decode_equals_expanded_prefill_on_the_same_cache(block_size):
    """Each sequence's token n-1 attended two ways over the same cached latents: as a decode
    (absorbed, batched) after n-1 cached tokens, and as the last row of a 2-token chunk
    (expanded from the cached latents) after n-2."""
    lengths = [3, 9, 22, 40]
    absorbed = Sequences(lengths, block_size, seed=7)
    expanded = Sequences(lengths, block_size, seed=7)
    every = list(range(len(lengths)))
    absorbed.step(every, [(0, n - 1) for n in lengths])
    decode = absorbed.step(every, [(n - 1, n) for n in lengths])
    expanded.step(every, [(0, n - 2) for n in lengths])
    chunk = expanded.step(every, [(n - 2, n) for n in lengths])
    for s, n in enumerate(lengths):
        torch.testing.assert_close(decode[s][0], chunk[s][-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode[s][0].double(), absorbed.reference(s, n - 1, n)[0],
                                   atol=1e-5, rtol=1e-5)


def test_bf16_latent_cache():
    seqs = Sequences([6, 9], block_size=4, seed=3, dtype=torch.bfloat16)
    seqs.step([0, 1], [(0, 5), (0, 9)])
    (out,) = seqs.step([0], [(5, 6)])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), seqs.reference(0, 5, 6), atol=3e-2, rtol=3e-2)


def test_padding_slots_are_not_written():
    cache = torch.randn(4, 4, RANK + ROPE)
    before = cache.clone()
    kv_c, k_pe = torch.randn(4, RANK), torch.randn(4, ROPE)
    NativeMLABackend.write_cache(kv_c, k_pe, cache, torch.tensor([5, -1, 9, -1]))
    flat, flat_before = cache.view(16, -1), before.view(16, -1)
    assert torch.equal(flat[5], torch.cat((kv_c[0], k_pe[0])))
    assert torch.equal(flat[9], torch.cat((kv_c[2], k_pe[2])))
    untouched = [s for s in range(16) if s not in (5, 9)]
    assert torch.equal(flat[untouched], flat_before[untouched])


def test_mla_layer_picks_the_mla_backend_and_sizes_a_latent_cache():
    info = get_registries().attention_backends.backends["native_mla"]
    assert info.cls is NativeMLABackend and info.kind == "mla"
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE)
    assert isinstance(layer.backend, NativeMLABackend) and layer.backend_name == "native_mla"
    assert layer.kv_cache_shape(10, 16) == (10, 16, RANK + ROPE)
    # A forced MHA backend is for the MHA layers; an unknown name is still an error.
    with build_context(BuildContext(torch.device("cpu"), torch.float32, "native")):
        assert MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE).backend_name == "native_mla"
    with build_context(BuildContext(torch.device("cpu"), torch.float32, "nope")):
        with pytest.raises(Exception, match="nope"):
            MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE)


def test_mla_layer_forward_needs_context_and_cache():
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE)
    args = (
        torch.randn(3, HEADS, NOPE), torch.randn(3, HEADS, ROPE), torch.randn(3, RANK),
        torch.randn(3, ROPE), torch.randn(HEADS * (NOPE + V), RANK),
    )
    with pytest.raises(RuntimeError, match="forward_context"):
        layer(*args)
    kv = PagedKV(num_blocks=4, block_size=4)
    meta, _ = kv.step([kv.add_sequence()], [3])
    with forward_context(meta), pytest.raises(RuntimeError, match="kv_cache is not set"):
        layer(*args)
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    with forward_context(meta):
        assert layer(*args).shape == (3, HEADS * V)


@pytest.mark.parametrize("kv_scale", [1.0, 0.0137])
def test_fp8_latent_cache_attends_over_what_it_stored(kv_scale):
    """``--kv_cache_dtype fp8``: each latent row stored as e4m3 of ``row / kv_scale``
    (saturated); every query (decodes, chunks after a cached prefix, a prompt computed in
    one step) attends over the stored rows times ``kv_scale``."""
    seqs = Sequences([p + n for p, n in MIXED], 4, seed=5, dtype=torch.float8_e4m3fn)
    seqs.backend.kv_scale = kv_scale
    for x in seqs.kv_c:
        x.mul_(4)
    if kv_scale < 1:  # some values past 448 * kv_scale: stored saturated
        assert any(bool((x.abs() > 448 * kv_scale).any()) for x in seqs.kv_c)
    cached = [(s, p) for s, (p, _) in enumerate(MIXED) if p]
    seqs.step([s for s, _ in cached], [(0, p) for _, p in cached])
    outs = seqs.step(list(range(len(MIXED))), [(p, p + n) for p, n in MIXED])

    def stored(x: torch.Tensor) -> torch.Tensor:
        scaled = (x * torch.tensor(1 / kv_scale)).clamp(-448, 448)
        return scaled.to(torch.float8_e4m3fn)

    for s, ((p, n), got) in enumerate(zip(MIXED, outs)):
        kv_c, k_pe = seqs.kv_c[s][: p + n], seqs.k_pe[s][: p + n]
        kv_c = stored(kv_c).double() * kv_scale
        k_pe = stored(k_pe).double() * kv_scale
        ref = dense_reference(seqs.q_nope[s][p:], seqs.q_pe[s][p:], kv_c, k_pe, seqs.w)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
        sid = seqs.ids[s]
        for pos in range(p + n):
            block = seqs.kv.tables[sid][pos // 4]
            row = torch.cat((seqs.kv_c[s][pos], seqs.k_pe[s][pos]))
            held = seqs.cache[block, pos % 4].view(torch.uint8)
            assert torch.equal(held, stored(row).view(torch.uint8))
