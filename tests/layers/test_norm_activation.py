import torch
import torch.nn.functional as F

from atom_core.layers.activation import SiluAndMul
from atom_core.layers.linear import MergedColumnParallelLinear
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
