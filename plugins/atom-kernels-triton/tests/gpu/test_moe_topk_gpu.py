"""The Triton router (``moe_route``) against the native one on the GPU: the real routers'
shapes from one token to a prefill's worth, and CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton.moe_topk import route, select_experts  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native.moe import select_experts as native_select  # noqa: E402

# name -> (experts, top_k, scoring, renormalize, groups, topk_group, bias, scaling)
ROUTERS = {
    "qwen3-30b-a3b": (128, 8, "softmax", True, None, None, False, 1.0),
    "deepseek-v2-lite": (64, 6, "softmax", False, None, None, False, 1.0),
    "deepseek-v3": (256, 8, "sigmoid", True, 8, 4, True, 2.5),
}


def router_inputs(name, tokens, seed=0):
    experts, top_k, scoring, renorm, groups, topk_group, has_bias, scale = ROUTERS[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    bias = 0.1 * torch.randn(experts, device="cuda", generator=g) if has_bias else None
    return logits, (top_k, scoring, renorm, groups, topk_group, bias, scale)


def by_id(weights, ids):
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


def check(weights, ids, logits, args):
    """Same experts (each row sorted by id: the kernel lists them best first, torch.topk
    in its own order) and weights. torch's and Triton's exp may differ in the last bit,
    which can flip a choice between two experts within an ulp of each other: a prefill's
    worth of random rows is allowed one such row in a thousand."""
    ref_weights, ref_ids = by_id(*native_select(logits, *args))
    weights, ids = by_id(weights, ids)
    same = (ids == ref_ids).all(dim=1)
    assert int((~same).sum()) <= logits.shape[0] // 1000
    torch.testing.assert_close(weights[same], ref_weights[same], rtol=1e-5, atol=1e-6)


def test_registered_for_cuda():
    assert resolve_op("moe_route", "cuda") is route


@pytest.mark.parametrize("tokens", [1, 16, 32, 128, 512])
@pytest.mark.parametrize("router", ["qwen3-30b-a3b", "deepseek-v2-lite"])
def test_route_matches_native(router, tokens):
    """The gate's GEMV (split along K at decode sizes, its partials summed in the top-k
    kernel; cuBLAS past 128 rows) and the choice, against F.linear and select_experts."""
    experts, hidden = ROUTERS[router][0], 2048  # both models' hidden size
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(experts, hidden, device="cuda", generator=g) / hidden**0.5
    args = router_inputs(router, tokens)[1]
    check(*route(x, w, *args), torch.nn.functional.linear(x.float(), w), args)


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 7, 64, 256, 1000, 4096])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_matches_native(router, tokens):
    logits, args = router_inputs(router, tokens, seed=tokens)
    check(*select_experts(logits, *args), logits, args)


@pytest.mark.parametrize("tokens", [1, 4, 32])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_cuda_graph_replay(router, tokens):
    """Captured once, replayed with other logits: nothing may be read on the host, and
    the capture-time routing must not be baked in."""
    logits, args = router_inputs(router, tokens)
    select_experts(logits, *args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = select_experts(logits, *args)
    for seed in (1, 2):
        logits.copy_(router_inputs(router, tokens, seed=seed)[0])
        graph.replay()
        check(weights, ids, logits, args)
