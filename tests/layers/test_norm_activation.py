from types import SimpleNamespace

import torch
import torch.nn.functional as F

from atom_core.layers.activation import SiluAndMul
from atom_core.layers.decoder import DecoderLayer, GatedMLP
from atom_core.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from atom_core.layers.norm import RMSNorm


def rms_ref(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_plain_and_fused_residual():
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    torch.testing.assert_close(norm(x), rms_ref(x, norm.weight, 1e-5))
    out, residual = norm(x, r)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(out, rms_ref(x + r, norm.weight, 1e-5))


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_rms_norm_project_is_norm_then_linear():
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    proj = MergedColumnParallelLinear(16, [8, 8], bias=True)
    proj.weight.data.normal_()
    proj.bias.data.normal_()
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    out, residual = norm.project(x, r, proj)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(out, proj(rms_ref(x + r, norm.weight, 1e-5)))
    out, residual = norm.project(x, None, proj)  # the first layer: no residual yet
    assert residual is x
    torch.testing.assert_close(out, proj(rms_ref(x, norm.weight, 1e-5)))


class _PlainMLP(torch.nn.Module):
    """An MLP without ``input_proj`` (as MoE blocks): the layer normalises, then calls it."""

    def __init__(self, mlp: GatedMLP) -> None:
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        return self.inner(x)


class _PlainAttn(torch.nn.Module):
    def __init__(self, attn) -> None:
        super().__init__()
        self.inner = attn

    def forward(self, positions, x):
        return self.inner(positions, x)


class _Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = ReplicatedLinear(16, 16, bias=False)
        self.qkv.weight.data.normal_()

    @property
    def input_proj(self):
        return self.qkv

    def forward(self, positions, x):
        return self.forward_projected(positions, self.qkv(x))

    def forward_projected(self, positions, y):
        return torch.tanh(y) + positions[:, None]


def test_decoder_layer_fuses_norms_into_input_projections():
    # Bitwise the unfused block: on CPU rms_norm_linear is the norm op then the linear op.
    config = SimpleNamespace(hidden_size=16, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    attn, mlp = _Attn(), GatedMLP(16, 24)
    for p in mlp.parameters():
        p.data.normal_(std=0.2)
    fused = DecoderLayer(config, attn, mlp)
    plain = DecoderLayer(config, _PlainAttn(attn), _PlainMLP(mlp))
    for layer in (fused, plain):
        layer.input_layernorm.weight.data.copy_(torch.linspace(0.5, 1.5, 16))
        layer.post_attention_layernorm.weight.data.copy_(torch.linspace(1.5, 0.5, 16))
    projected = []
    for norm in (fused.input_layernorm, fused.post_attention_layernorm):
        norm.project = lambda *a, _f=norm.project: projected.append(a[2]) or _f(*a)
    positions, x = torch.arange(3.0), torch.randn(3, 16)
    for residual in (None, torch.randn(3, 16)):
        got, want = fused(positions, x, residual), plain(positions, x, residual)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert projected == [attn.qkv, mlp.gate_up_proj] * 2
