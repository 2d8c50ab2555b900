import pytest
import torch

from atom_core.errors import UnsupportedError
from atom_core.layers.attention.layer import Attention
from atom_core.layers.attention.native import NativeAttentionBackend
from atom_core.layers.context import BuildContext, build_context, forward_context
from atom_core.layers.norm import RMSNorm
from atom_core.layers.rotary import RotaryEmbedding
from atom_core.plugins import get_registries
from atom_core.testing.paged_kv import PagedKV


def test_native_backend_is_registered_for_every_device():
    info = get_registries().attention_backends.backends["native"]
    assert info.cls is NativeAttentionBackend
    assert info.kind == "mha" and set(info.device_kinds) == {"cpu", "cuda", "hip"}


def test_layer_picks_backend_and_sizes_its_cache():
    layer = Attention(num_heads=4, head_dim=8, scale=0.5, num_kv_heads=2)
    assert isinstance(layer.backend, NativeAttentionBackend)
    assert layer.kv_cache_shape(10, 16) == (2, 10, 16, 2, 8)


def test_forced_unknown_backend_is_a_clear_error():
    with build_context(BuildContext(torch.device("cpu"), torch.float32, "nope")):
        with pytest.raises(UnsupportedError, match="nope"):
            Attention(4, 8, 0.5, 2)


def test_forward_without_context_or_cache_says_what_is_missing():
    layer = Attention(4, 8, 0.5, 2)
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="forward_context"):
        layer(q, k, v)
    kv = PagedKV(num_blocks=4, block_size=4)
    meta, _ = kv.step([kv.add_sequence()], [3])
    with forward_context(meta), pytest.raises(RuntimeError, match="kv_cache is not set"):
        layer(q, k, v)
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    with forward_context(meta):
        assert layer(q, k, v).shape == (3, 32)


def test_cache_written_skips_the_backends_write():
    layer = Attention(4, 8, 0.5, 2)
    assert layer.accepts_written_cache
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    kv = PagedKV(num_blocks=4, block_size=4)
    meta, _ = kv.step([kv.add_sequence()], [3])
    cache = torch.full(layer.kv_cache_shape(4, 4), float("nan"))
    # A fresh prefill attends over k, v alone; the caller's fused op owns the write.
    out = layer.backend.forward(q, k, v, cache, meta, cache_written=True)
    assert cache.isnan().all()
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    with forward_context(meta):
        assert torch.equal(layer(q, k, v), out)


def test_rope_needs_positions_and_norms_come_in_pairs():
    rope = RotaryEmbedding(8, 8, 16, 10000.0)
    layer = Attention(4, 8, 0.5, 2, rope=rope)
    kv = PagedKV(num_blocks=4, block_size=4)
    meta, _ = kv.step([kv.add_sequence()], [3])
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    with forward_context(meta), pytest.raises(ValueError, match="positions"):
        layer(torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16))
    with pytest.raises(ValueError, match="together"):
        Attention(4, 8, 0.5, 2, rope=rope, q_norm=RMSNorm(8))
    with pytest.raises(ValueError, match="head size"):
        Attention(4, 16, 0.5, 2, rope=rope)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("written_cache", [True, False], ids=["one-op", "norm-and-rope-ops"])
def test_attention_input_by_default_is_the_ops_then_attention(written_cache, qk_norm):
    # The default forward_input: qk_norm_rope_cache_write where the backend takes a written
    # cache, else the rms_norm op per head; then the rotary op. Either way the same output
    # and cache as applying the norms and RoPE by hand, then attention of plain q, k, v.
    from atom_core.ops.native.norm import rms_norm
    from atom_core.ops.native.rotary import rotary_embedding

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n, generator=g) for n in (32, 16, 16))
    rope = RotaryEmbedding(8, 8, 16, 10000.0)
    q_norm, k_norm = RMSNorm(8), RMSNorm(8)
    q_norm.weight.data = 1 + 0.1 * torch.randn(8, generator=g)
    k_norm.weight.data = 1 + 0.1 * torch.randn(8, generator=g)
    norms = {"q_norm": q_norm, "k_norm": k_norm} if qk_norm else {}
    positions = torch.tensor([0, 1, 2])
    kv = PagedKV(num_blocks=4, block_size=4)
    meta, _ = kv.step([kv.add_sequence()], [3])
    layer = Attention(4, 8, 0.5, 2, rope=rope, **norms)
    layer.backend.accepts_written_cache = written_cache
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    with forward_context(meta):
        got = layer(q, k, v, positions)
    plain = Attention(4, 8, 0.5, 2)
    plain.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    qn, kn = q, k
    if qk_norm:
        qn = rms_norm(q.reshape(-1, 8), q_norm.weight, q_norm.eps).view(q.shape)
        kn = rms_norm(k.reshape(-1, 8), k_norm.weight, k_norm.eps).view(k.shape)
    qn, kn = rotary_embedding(positions, qn, kn, 8, rope.cos_sin_cache, True)
    with forward_context(meta):
        ref = plain(qn, kn, v)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.kv_cache, plain.kv_cache, rtol=1e-6, atol=1e-6)
    assert layer.kv_cache.abs().sum() > 0
