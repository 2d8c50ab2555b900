"""Attention sinks and sliding windows: the native backend against a dense reference
written the way transformers' eager gpt-oss attention is, and the layer's choice of a
backend that implements them."""

import logging

import pytest
import torch

from atom_core.errors import UnsupportedError
from atom_core.layers.attention.layer import Attention
from atom_core.layers.attention.native import NativeAttentionBackend
from atom_core.layers.context import BuildContext, build_context
from atom_core.plugins import get_registries
from atom_core.registries import AttentionBackendInfo
from atom_core.testing.paged_kv import PagedKV


def dense_reference(q, k, v, scale, sinks=None, window=None):
    """q [Lq, H, D], the last Lq of the L tokens of k/v [L, kvh, D]; fp64. Each head's
    sink logit is a softmax column that is dropped after the softmax."""
    query_len, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    rows = torch.arange(length - query_len, length)[:, None]
    cols = torch.arange(length)
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.double().view(heads, 1, 1).expand(heads, query_len, 1)
        scores = torch.cat((scores, column), dim=-1)
    probs = scores.softmax(-1)[..., :length]
    return torch.einsum("hqk,khd->qhd", probs, v)


# (context length before this step, tokens computed this step): windows are crossed by
# whole prompts, by chunks after a cached prefix, and by decodes.
MIXED = [(0, 13), (16, 7), (4, 1), (36, 1), (0, 1), (3, 5), (0, 2)]
DECODES = [(4, 1), (36, 1), (0, 1), (17, 1)]
PREFILLS = [(0, 9), (13, 3), (5, 20)]


@pytest.mark.parametrize("sinks,window", [(True, None), (False, 5), (True, 5), (True, 1)],
                         ids=["sinks", "window", "both", "window-1"])
@pytest.mark.parametrize("batch", [MIXED, DECODES, PREFILLS], ids=["mixed", "decode", "prefill"])
def test_native_matches_dense_reference(batch, sinks, window):
    heads, kv_heads, head_dim, block_size, scale = 8, 2, 16, 4, 16**-0.5
    g = torch.Generator().manual_seed(len(batch) * 10 + (window or 0))
    backend = NativeAttentionBackend(heads, head_dim, kv_heads, scale)
    # Sinks large enough to matter against scores of order one.
    backend.sinks = torch.randn(heads, generator=g) * 2 if sinks else None
    backend.sliding_window = window
    kv = PagedKV(num_blocks=64, block_size=block_size, seed=5)
    cache = torch.full(backend.kv_cache_shape(kv.num_blocks, block_size, kv_heads, head_dim),
                       float("nan"))
    ids = [kv.add_sequence() for _ in batch]
    full_k = [torch.randn(p + n, kv_heads, head_dim, generator=g) for p, n in batch]
    full_v = [torch.randn(p + n, kv_heads, head_dim, generator=g) for p, n in batch]
    cached = [(sid, p) for sid, (p, _) in zip(ids, batch) if p]
    if cached:
        meta, _ = kv.step([s for s, _ in cached], [p for _, p in cached])
        NativeAttentionBackend.write_cache(torch.cat([full_k[s][:p] for s, p in cached]),
                                           torch.cat([full_v[s][:p] for s, p in cached]),
                                           cache, meta.slot_mapping)
    meta, _ = kv.step(ids, [n for _, n in batch])
    q = [torch.randn(n, heads, head_dim, generator=g) for _, n in batch]
    k_new = torch.cat([k[p:] for k, (p, _) in zip(full_k, batch)])
    v_new = torch.cat([v[p:] for v, (p, _) in zip(full_v, batch)])
    out = backend.forward(torch.cat(q).flatten(1), k_new.flatten(1), v_new.flatten(1), cache,
                          meta)
    for i, rows in enumerate(out.split([n for _, n in batch])):
        ref = dense_reference(q[i], full_k[i], full_v[i], scale, backend.sinks, window)
        torch.testing.assert_close(rows.view_as(q[i]).double(), ref, atol=1e-5, rtol=1e-5)


class _PlainBackend(NativeAttentionBackend):
    supports_sinks = False
    supports_sliding_window = False


@pytest.fixture
def plain_backend_first(monkeypatch):
    """A higher-priority CPU backend with neither sinks nor windows."""
    backends = get_registries().attention_backends.backends
    monkeypatch.setitem(backends, "plain", AttentionBackendInfo(
        "plain", _PlainBackend, ("cpu",), "mha", 100, "test"))


def test_layer_hands_sinks_and_window_to_a_backend_that_has_them(plain_backend_first, caplog):
    assert Attention(4, 8, 0.5, 2).backend_name == "plain"
    sinks = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger="atom_core.layers.attention.layer"):
        layer = Attention(4, 8, 0.5, 2, sinks=sinks, sliding_window=16)
    assert layer.backend_name == "native"
    assert layer.backend.sinks is sinks and layer.backend.sliding_window == 16
    assert "plain has no attention sinks or sliding window" in caplog.text
    forced = BuildContext(torch.device("cpu"), torch.float32, "plain")
    with build_context(forced), pytest.raises(UnsupportedError, match="no sliding window"):
        Attention(4, 8, 0.5, 2, sliding_window=16)
