import torch
import torch.nn.functional as F

from atom_core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


def _load(layer, **tensors):
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, t)


def test_plain_linears_match_f_linear():
    x = torch.randn(5, 12)
    w, b = torch.randn(7, 12), torch.randn(7)
    for cls in (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear):
        layer = cls(12, 7, bias=True)
        _load(layer, weight=w, bias=b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_qkv_loads_separate_checkpoint_tensors():
    hidden, head, heads, kv_heads = 16, 4, 4, 2
    layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True)
    assert (layer.q_size, layer.kv_size) == (16, 8)
    parts = {s: (torch.randn(n, hidden), torch.randn(n))
             for s, n in (("q", 16), ("k", 8), ("v", 8))}
    for shard, (w, b) in parts.items():
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, b, shard)
    x = torch.randn(3, hidden)
    q, k, v = layer(x).split([16, 8, 8], dim=-1)
    for got, (w, b) in zip((q, k, v), parts.values()):
        torch.testing.assert_close(got, F.linear(x, w, b))


def test_merged_gate_up_loads_by_index():
    layer = MergedColumnParallelLinear(8, [6, 6])
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
