"""DecoderModel's auxiliary hidden states (what an EAGLE-3 draft reads): the input of each
listed layer, which transformers reports as ``output_hidden_states[i]``, in the plain and
the fused stack, over a prefill and a decode step, and where the stream comes as a
``DeferredNorm``."""

from __future__ import annotations

import pytest
import torch

from atom_core.config import Config
from atom_core.fusion.decoder import FusedDecoderModel
from atom_core.layers.context import forward_context
from atom_core.layers.decoder import DecoderModel
from atom_core.loader import load_model
from atom_core.ops.deferred_norm import DeferredNorm
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches
from atom_core.testing.tiny_models import hf_model, tiny_model_dir

TOKENS = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46, 26]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def reference(request):
    """(kind, transformers' hidden states over TOKENS: [layers + 1] of [T, hidden])."""
    with torch.no_grad():
        out = hf_model(request.param)(torch.tensor([TOKENS]), output_hidden_states=True)
    return request.param, [h[0] for h in out.hidden_states]


@pytest.mark.parametrize("fuse", [True, False])
def test_captured_layer_inputs_equal_transformers_hidden_states(reference, fuse):
    kind, expected = reference
    model = load_model(Config.from_kwargs(model=str(tiny_model_dir(kind))), "cpu",
                       torch.float32, fuse=fuse).model
    stack = model.model
    assert type(stack) is (FusedDecoderModel if fuse else DecoderModel)
    layers = len(stack.layers)
    wanted = (layers - 1, 0, 1, layers - 1)  # any order, repeats allowed
    stack.aux_hidden_layers = wanted
    kv = PagedKV(num_blocks=8, block_size=4)
    allocate_kv_caches(model, kv)
    seq = kv.add_sequence()
    got: list[list[torch.Tensor]] = []
    for chunk in (TOKENS[:-1], TOKENS[-1:]):  # a prefill, then a decode step
        meta, positions = kv.step([seq], [len(chunk)])
        with torch.no_grad(), forward_context(meta):
            out = model(torch.tensor(chunk), positions)
        assert all(h.shape == out.shape for h in stack.aux_hidden_states)
        got.append(stack.aux_hidden_states)
    assert len(got[0]) == len(wanted)
    for j, layer in enumerate(wanted):
        captured = torch.cat([got[0][j], got[1][j]])
        torch.testing.assert_close(captured, expected[layer], rtol=1e-5, atol=1e-5)
    # The first layer's input is the embedding itself; a later one is a sum.
    assert torch.equal(got[0][1], stack.embed_tokens(torch.tensor(TOKENS[:-1])))


def test_a_deferred_norm_hands_on_its_sum(reference):
    """On GPUs a layer's MLP may finish the next layer's input norm: the stream then comes
    as a ``DeferredNorm`` whose ``summed`` is the sum, beside a stale residual. The CPU's
    ops decline to defer, so the first layer hands one on by hand here."""
    kind, expected = reference
    model = load_model(Config.from_kwargs(model=str(tiny_model_dir(kind))), "cpu",
                       torch.float32).model
    stack = model.model
    stack.aux_hidden_layers = (1,)
    first, norm = stack.layers[0], stack.layers[1].input_layernorm
    forward = first.forward

    def deferring(positions, hidden_states, residual, next_layer=None):
        out, residual = forward(positions, hidden_states, residual, next_layer)
        h = out + residual
        sumsq = h.float().pow(2).sum(-1)[None]
        return DeferredNorm(h, h * norm.weight, sumsq, norm.weight, norm.eps), residual

    first.forward = deferring
    kv = PagedKV(num_blocks=8, block_size=4)
    allocate_kv_caches(model, kv)
    meta, positions = kv.step([kv.add_sequence()], [len(TOKENS)])
    with torch.no_grad(), forward_context(meta):
        model(torch.tensor(TOKENS), positions)
    torch.testing.assert_close(stack.aux_hidden_states[0], expected[1], rtol=1e-5, atol=1e-5)


def test_nothing_is_kept_by_default():
    model = load_model(Config.from_kwargs(model=str(tiny_model_dir("llama"))), "cpu",
                       torch.float32).model
    kv = PagedKV(num_blocks=8, block_size=4)
    allocate_kv_caches(model, kv)
    meta, positions = kv.step([kv.add_sequence()], [4])
    with torch.no_grad(), forward_context(meta):
        model(torch.tensor(TOKENS[:4]), positions)
    assert model.model.aux_hidden_layers == () and model.model.aux_hidden_states == []
