import pytest
import torch

from atom_core.errors import UnsupportedError
from atom_core.layers.attention.backend import QKNormRope
from atom_core.layers.attention.layer import Attention
from atom_core.layers.attention.native import NativeAttentionBackend
from atom_core.layers.context import BuildContext, build_context, forward_context
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


def test_cache_written_skips_the_write_and_is_refused_where_unsupported():
    layer = Attention(4, 8, 0.5, 2)
    assert layer.accepts_written_cache
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    kv = PagedKV(num_blocks=4, block_size=4)
    meta, _ = kv.step([kv.add_sequence()], [3])
    layer.kv_cache = torch.full(layer.kv_cache_shape(4, 4), float("nan"))
    with forward_context(meta):
        out = layer(q, k, v, cache_written=True)  # a fresh prefill: attends over k, v alone
    assert layer.kv_cache.isnan().all()  # the caller's fused op owns the write
    layer.kv_cache.zero_()
    with forward_context(meta):
        assert torch.equal(layer(q, k, v), out)
    layer.backend.accepts_written_cache = False  # e.g. a backend with its own cache layout
    with forward_context(meta), pytest.raises(RuntimeError, match="cache_written"):
        layer(q, k, v, cache_written=True)


@pytest.mark.parametrize("written_cache", [True, False], ids=["one-op", "norm-and-rope-ops"])
def test_qk_norm_rope_input_by_default_is_the_ops_then_attention(written_cache):
    # The default forward_qk_norm_rope: qk_norm_rope_cache_write where the backend takes a
    # written cache, else the rms_norm op per head and the rotary op; either way the same
    # output and cache as applying the norms and RoPE by hand, then forward(q, k, v).
    from atom_core.ops.native.norm import rms_norm
    from atom_core.ops.native.rotary import rotary_embedding

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n, generator=g) for n in (32, 16, 16))
    spec = QKNormRope(1 + 0.1 * torch.randn(8, generator=g), 1 + 0.1 * torch.randn(8, generator=g), 1e-6,
                      torch.tensor([0, 1, 2]), torch.randn(4, 8, generator=g), True)
    kv = PagedKV(num_blocks=4, block_size=4)
    meta, _ = kv.step([kv.add_sequence()], [3])
    layer = Attention(4, 8, 0.5, 2)
    layer.backend.accepts_written_cache = written_cache
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    with forward_context(meta):
        got = layer.forward_qk_norm_rope(q, k, v, spec)
    got_cache, layer.kv_cache = layer.kv_cache, torch.zeros(layer.kv_cache_shape(4, 4))
    qn = rms_norm(q.reshape(-1, 8), spec.q_weight, spec.eps).view(q.shape)
    kn = rms_norm(k.reshape(-1, 8), spec.k_weight, spec.eps).view(k.shape)
    qn, kn = rotary_embedding(spec.positions, qn, kn, 8, spec.cos_sin_cache, True)
    with forward_context(meta):
        ref = layer(qn, kn, v)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_cache, layer.kv_cache, rtol=1e-6, atol=1e-6)
    assert got_cache.abs().sum() > 0
