"""The fusion pass: plain model code in, the fused decode step out, with the plain modules'
results (bitwise on CPU, where the reference ops decline to defer a norm and
``rms_norm_linear`` is the norm op then the linear op)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom_core.config import Config
from atom_core.fusion import fuse_model
from atom_core.fusion.decoder import FusedDecoderLayer, FusedDecoderModel
from atom_core.fusion.sublayers import FusedGatedMLP, Projected
from atom_core.layers.context import forward_context
from atom_core.layers.decoder import DecoderLayer, DecoderModel, GatedMLP
from atom_core.layers.linear import ReplicatedLinear, RowParallelLinear
from atom_core.loader import load_model
from atom_core.ops.deferred_norm import AddNorm
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches
from atom_core.testing.tiny_models import tiny_model_dir

CONFIG = SimpleNamespace(hidden_size=16, rms_norm_eps=1e-6, vocab_size=32)


class _Attn(torch.nn.Module):
    """The attention shape the fusion takes: input through qkv_proj, output o_proj's."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = ReplicatedLinear(16, 16)
        self.o_proj = RowParallelLinear(16, 16)

    def forward(self, positions, x):
        return self.o_proj(torch.tanh(self.qkv_proj(x)) + positions[:, None])


class _OddAttn(_Attn):
    """The same modules, but the output is not o_proj's."""

    def forward(self, positions, x):
        return torch.tanh(self.qkv_proj(x)) + positions[:, None]


def _stack(attn_cls: type = _Attn) -> DecoderModel:
    torch.manual_seed(0)
    model = DecoderModel(CONFIG, [DecoderLayer(CONFIG, attn_cls(), GatedMLP(16, 24))
                                  for _ in range(3)])
    for p in model.parameters():
        p.data.normal_(std=0.3)
    return model


def test_fused_stack_equals_the_plain_one_and_keeps_its_names():
    plain, fused = _stack(), _stack()
    names = [n for n, _ in plain.named_parameters()]
    report = fuse_model(fused, "cpu")
    assert report == ["model: 3 layers, fused attention in 3, fused MLP/MoE in 3"]
    assert type(fused) is FusedDecoderModel
    assert all(type(layer) is FusedDecoderLayer for layer in fused.layers)
    assert all(type(layer.mlp) is FusedGatedMLP for layer in fused.layers)
    assert [n for n, _ in fused.named_parameters()] == names
    # Every norm runs with the projection that reads it (the CPU's ops decline to defer
    # one), and every sublayer but the last is asked to finish the next norm.
    projected, asked = [], []
    for layer in fused.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.project = lambda *a, _f=norm.project: projected.append(a[2]) or _f(*a)
        for finisher in (layer.self_attn.o_proj, layer.mlp):
            cls = type(finisher)
            finisher.__class__ = type(cls.__name__, (cls,), {
                "forward": lambda self, *a, _c=cls: asked.append(self.pending)
                or _c.forward(self, *a)})
    ids, positions = torch.tensor([1, 5, 7]), torch.arange(3)
    with torch.no_grad():
        assert torch.equal(fused(ids, positions), plain(ids, positions))
    first = fused.layers[0]
    assert projected[:2] == [first.self_attn.qkv_proj, first.mlp.gate_up_proj]
    assert len(projected) == 6
    assert all(isinstance(a, AddNorm) for a in asked[:-1]) and asked[-1] is None  # last MLP


def test_projected_input_is_handed_on():
    fused = _stack()
    fuse_model(fused, "cpu")
    y = torch.randn(2, 16)
    assert fused.layers[0].self_attn.qkv_proj(Projected(y)) is y


def test_other_shapes_run_as_written_and_a_broken_promise_is_loud():
    class _MLP(torch.nn.Module):
        def forward(self, x):
            return 2 * x

    model = DecoderModel(CONFIG, [DecoderLayer(CONFIG, _Attn(), _MLP())])
    assert fuse_model(model, "cpu") == ["model: 1 layers, fused attention in 1, fused MLP/MoE in 0"]
    assert model.layers[0].mlp_parts is None
    with torch.no_grad():
        model(torch.tensor([1, 2]), torch.arange(2))

    odd = _stack(_OddAttn)
    fuse_model(odd, "cpu")
    with torch.no_grad(), pytest.raises(RuntimeError, match="_OddAttn did not return"):
        odd(torch.tensor([1, 2]), torch.arange(2))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_loaded_models_fused_and_plain_agree(kind):
    config = Config.from_kwargs(model=str(tiny_model_dir(kind)))
    models = [load_model(config, "cpu", torch.float32, fuse=f).model for f in (True, False)]
    assert type(models[0].model) is FusedDecoderModel and type(models[1].model) is DecoderModel
    logits = []
    for model in models:
        kv = PagedKV(num_blocks=16, block_size=4, seed=1)
        allocate_kv_caches(model, kv)
        seq = kv.add_sequence()
        out = []
        for tokens in ([3, 1, 4, 1, 5], [9], [2]):
            meta, positions = kv.step([seq], [len(tokens)])
            with torch.no_grad(), forward_context(meta):
                out.append(model.compute_logits(model(torch.tensor(tokens), positions)))
        logits.append(out)
    for a, b in zip(*logits):
        assert torch.equal(a, b)
