"""The Triton clamped_swiglu_moe against the core's reference on the GPU, at gpt-oss-20b's
expert shapes (hidden 2880, intermediate 2880, 32 experts, top-4): bf16 and MXFP4 stacks at
1, 32 and 256 tokens, fp16/fp32 activations, biases or none, out-of-range ids, CUDA-graph
replay with other routing, and run-to-run determinism.

Tolerances: ``triton_reference.tolerance`` of the activations' dtype on the relative
Frobenius error (both sides read the same weights and round where the reference does)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton.clamped_swiglu_moe import clamped_swiglu_moe  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native.clamped_swiglu_moe import (  # noqa: E402
    clamped_swiglu_moe as reference,
)
from atom_core.quant.mxfp4 import BLOCK, Mxfp4Weight  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 32, 4, 2880, 2880  # gpt-oss-20b
ALPHA, LIMIT = 1.702, 7.0  # its swiglu_alpha and swiglu_limit
_stacks: dict = {}


def stacks(kind: str):
    """(w13, w13_bias, w2, w2_bias), built once a kind: bf16 weights, or MXFP4 stacks of
    random codes with scales that give outputs of order one (about 2**-7 a weight)."""
    if kind not in _stacks:
        g = torch.Generator(device="cuda").manual_seed(0)

        def mxfp4(n, k):
            blocks = torch.randint(0, 256, (EXPERTS, n, k // 2), device="cuda", generator=g,
                                   dtype=torch.uint8)
            scales = torch.randint(119, 122, (EXPERTS, n, k // BLOCK), device="cuda",
                                   generator=g, dtype=torch.uint8)
            return Mxfp4Weight(blocks, scales)

        def plain(n, k):
            return (torch.randn(EXPERTS, n, k, device="cuda", generator=g) / k**0.5).bfloat16()

        make = mxfp4 if kind == "mxfp4" else plain
        w13, w2 = make(2 * INTER, HIDDEN), make(HIDDEN, INTER)
        b13 = torch.randn(EXPERTS, 2 * INTER, device="cuda", generator=g) * 0.5
        b2 = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) * 0.5
        _stacks[kind] = (w13, b13, w2, b2)
    return _stacks[kind]


def routed(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Scaled so that some gate and up values pass the limit.
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g) * 3
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    values, ids = logits.topk(TOP_K, dim=-1)
    return x, values.softmax(dim=-1), ids


def case(kind: str, tokens: int, dtype=torch.bfloat16, seed: int = 1):
    w13, b13, w2, b2 = stacks(kind)
    x, weights, ids = routed(tokens, seed)
    return x.to(dtype), w13, b13.to(dtype), w2, b2.to(dtype), weights, ids


def check(args, dtype=torch.bfloat16):
    got = clamped_swiglu_moe(*args, ALPHA, LIMIT)
    ref = reference(*args, ALPHA, LIMIT)
    assert got.dtype == ref.dtype == dtype
    err = rel_err(got, ref)
    assert err < tolerance(dtype), err
    return got


def test_registered_for_cuda():
    assert "atom_kernels_triton" in resolve_op("clamped_swiglu_moe", "cuda").__module__


@pytest.mark.parametrize("tokens", [1, 32, 256])
@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_matches_reference(kind, tokens):
    check(case(kind, tokens))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype):
    check(case("mxfp4", 32, dtype), dtype)


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_biases_may_be_none(kind):
    x, w13, b13, w2, _, weights, ids = case(kind, 32)
    check((x, w13, b13, w2, None, weights, ids))
    check((x, w13, None, w2, None, weights, ids))


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_out_of_range_ids(kind):
    x, w13, b13, w2, b2, weights, ids = case(kind, 64)
    ids = ids.clone()
    ids[::3, 0] = -1
    ids[1::5, -1] = EXPERTS
    ids[7] = -1
    got = check((x, w13, b13, w2, b2, weights, ids))
    assert not got[7].any()


@pytest.mark.parametrize("tokens", [1, 32, 256])
@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_cuda_graph_replay(kind, tokens):
    """Captured once, replayed with other hidden rows and routing: the launch reads nothing
    back to the host (capture would fail) and bakes no capture-time routing in."""
    args = list(case(kind, tokens))
    clamped_swiglu_moe(*args, ALPHA, LIMIT)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = clamped_swiglu_moe(*args, ALPHA, LIMIT)
    x, weights, ids = args[0], args[5], args[6]
    for seed in (2, 3):
        nx, nweights, nids = routed(tokens, seed)
        nids[0, 0] = -1
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        graph.replay()
        ref = reference(*args, ALPHA, LIMIT)
        assert rel_err(out, ref) < tolerance(torch.bfloat16)


def test_deterministic():
    args = case("mxfp4", 256)
    assert torch.equal(clamped_swiglu_moe(*args, ALPHA, LIMIT),
                       clamped_swiglu_moe(*args, ALPHA, LIMIT))
