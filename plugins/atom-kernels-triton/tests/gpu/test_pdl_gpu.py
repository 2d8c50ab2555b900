"""Programmatic dependent launch (ops/triton/pdl.py): a chain of decode kernels, each
reading the one before's output, replayed from a CUDA graph with PDL on must give bitwise
the outputs of the same chain with PDL off. A kernel that read its input before waiting
would see the previous replay's values and fail this."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton import pdl  # noqa: E402
from atom_kernels_triton.activation import silu_and_mul  # noqa: E402
from atom_kernels_triton.gemv import linear  # noqa: E402
from atom_kernels_triton.gemv_config import GemvConfig  # noqa: E402
from atom_kernels_triton.norm import fused_add_rms_norm  # noqa: E402

HOPPER = torch.cuda.get_device_capability()[0] >= 9
SPLIT = GemvConfig(BLOCK_N=16, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=2)


def set_pdl(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("ATOM_PDL", "1" if on else "0")
    pdl._options.cache_clear()


def layer_chain(x, res, ws, norm_w):
    for w_up, w_down in ws:
        h, res = fused_add_rms_norm(x, res, norm_w, 1e-6)
        up = linear(h, w_up)
        x = linear(silu_and_mul(up), w_down, config=SPLIT)  # split-K: gemv + reduce kernels
    return x, res


def run(monkeypatch, on: bool, rows: int, replays: int = 20) -> list[torch.Tensor]:
    set_pdl(monkeypatch, on)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 1024, 3072
    ws = [(torch.randn(2 * inter, hidden, device="cuda", generator=g, dtype=torch.bfloat16) * 0.03,
           torch.randn(hidden, inter, device="cuda", generator=g, dtype=torch.bfloat16) * 0.03)
          for _ in range(6)]
    norm_w = torch.rand(hidden, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
    x_in = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    res_in = torch.empty_like(x_in)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer_chain(x_in, res_in, ws, norm_w)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = layer_chain(x_in, res_in, ws, norm_w)
    outs = []
    for i in range(replays):  # new inputs every replay: a stale read shows up as a mismatch
        x_in.copy_(torch.randn(rows, hidden, device="cuda", generator=g) * (1 + i % 3))
        res_in.copy_(torch.randn(rows, hidden, device="cuda", generator=g))
        graph.replay()
        outs.append(torch.cat([out, res]).clone())
    set_pdl(monkeypatch, True)
    return outs


@pytest.mark.skipif(not HOPPER, reason="PDL needs sm_90 or later")
def test_pdl_is_on_by_default_on_hopper(monkeypatch):
    monkeypatch.delenv("ATOM_PDL", raising=False)
    pdl._options.cache_clear()
    assert pdl.pdl_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("rows", [1, 4])
def test_graph_chain_with_pdl_is_bitwise_the_chain_without(monkeypatch, rows):
    with_pdl = run(monkeypatch, True, rows)
    without = run(monkeypatch, False, rows)
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
    assert not torch.equal(with_pdl[0], with_pdl[1])  # the inputs really changed
