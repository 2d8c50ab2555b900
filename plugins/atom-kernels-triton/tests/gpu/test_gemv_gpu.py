"""The Triton ``linear`` against F.linear on the GPU: the real decode projections and LM
heads, every M up to the threshold, bf16/fp16/fp32, split-K determinism and CUDA-graph
replay; ``silu_and_mul_linear`` on the real down projections, and bitwise the unfused pair;
``rms_norm_linear`` on the projections that follow a norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from atom_kernels_triton.activation import silu_and_mul  # noqa: E402
from atom_kernels_triton.gemv import linear, rms_norm_linear, silu_and_mul_linear, supported  # noqa: E402
from atom_kernels_triton.gemv_config import (  # noqa: E402
    MAX_ROWS,
    ROW_BLOCKS_MAX_ROWS,
    WIDE_ROWS,
    GemvConfig,
    default_config,
)
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native import activation as native_act  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (N, K) of the projections that go through the op (bench/gemv.py lists them per model).
SHAPES = {
    "qwen3-0.6b.qkv": (4096, 1024),
    "qwen3-0.6b.o": (1024, 2048),
    "qwen3-0.6b.gate_up": (6144, 1024),
    "qwen3-0.6b.down": (1024, 3072),
    "qwen3-0.6b.lm_head": (151936, 1024),
    "qwen3-8b.qkv": (6144, 4096),
    "qwen3-8b.o": (4096, 4096),
    "qwen3-8b.gate_up": (24576, 4096),
    "qwen3-8b.down": (4096, 12288),
    "qwen3-30b-a3b.qkv": (5120, 2048),
    "qwen3-30b-a3b.o": (2048, 4096),
    "deepseek-v2-lite.kv_a": (576, 2048),
    "deepseek-v2-lite.mlp.down": (2048, 10944),
}
DOWN_SHAPES = ["qwen3-0.6b.down", "qwen3-8b.down", "deepseek-v2-lite.mlp.down"]
# The shapes with a 32-row tile in the table (gemv_config.WIDE_ROWS).
WIDE_SHAPES = ["qwen3-8b.qkv", "qwen3-8b.o", "qwen3-8b.gate_up", "qwen3-8b.down",
               "qwen3-30b-a3b.qkv", "qwen3-30b-a3b.o"]
_weights: dict = {}


def weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    key = (n, k, dtype)
    if key not in _weights:
        _weights.clear()  # one shape at a time (the LM heads are GBs in fp32)
        g = torch.Generator(device="cuda").manual_seed(0)
        _weights[key] = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    return _weights[key]


def rand(*shape, dtype, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_shapes_every_m(shape, dtype):
    n, k = SHAPES[shape]
    w = weight(n, k, dtype)
    for m in range(1, MAX_ROWS + 1):
        x = rand(m, k, dtype=dtype, seed=m)
        got = linear(x, w)
        ref = F.linear(x.float(), w.float())
        assert got.dtype == dtype
        assert rel_err(got, ref) < tolerance(dtype), (shape, m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", WIDE_SHAPES)
def test_wide_rows_real_shapes(shape, dtype):
    n, k = SHAPES[shape]
    w = weight(n, k, dtype)
    for m in range(MAX_ROWS + 1, WIDE_ROWS + 1):
        x = rand(m, k, dtype=dtype, seed=m)
        assert supported(x, w, None), (shape, m)
        got = linear(x, w)
        assert rel_err(got, F.linear(x.float(), w.float())) < tolerance(dtype), (shape, m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_bias_and_3d_input(dtype, m):
    n, k = 1000, 777  # off every block size
    w, b = rand(n, k, dtype=dtype), rand(n, dtype=dtype, seed=2)
    x = rand(m, 2, k, dtype=dtype, seed=3)
    for split in (1, 4):
        c = GemvConfig(BLOCK_N=16, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=3)
        got = linear(x, w, b, config=c)
        assert got.shape == (m, 2, n)
        assert rel_err(got, F.linear(x.float(), w.float(), b.float())) < tolerance(dtype)


@pytest.mark.parametrize("m", [1, 4])
def test_split_k_is_bitwise_reproducible(m):
    n, k = SHAPES["qwen3-0.6b.down"]
    w, x = weight(n, k, torch.bfloat16), rand(m, k, dtype=torch.bfloat16)
    config = default_config(m, n, k, 2)
    assert config["SPLIT_K"] > 1  # the heuristic splits this shape
    first = linear(x, w, config=config)
    for _ in range(20):
        assert torch.equal(linear(x, w, config=config), first)


@pytest.mark.parametrize(
    "shape,m",
    [(s, m) for s in ("qwen3-0.6b.qkv", "qwen3-0.6b.down", "qwen3-0.6b.lm_head") for m in (1, 8)]
    + [("qwen3-8b.down", WIDE_ROWS), ("qwen3-30b-a3b.o", 24)],
)
def test_cuda_graph_replay_equals_eager(shape, m):
    n, k = SHAPES[shape]
    w = weight(n, k, torch.bfloat16)
    x = rand(m, k, dtype=torch.bfloat16)
    b = rand(n, dtype=torch.bfloat16, seed=2)
    eager = linear(x, w, b)  # also compiles before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w, b)
    x.copy_(rand(m, k, dtype=torch.bfloat16, seed=5))  # replay reads the new input
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, linear(x, w, b))
    assert not torch.equal(out, eager)


def test_registered_for_cuda():
    assert resolve_op("linear", "cuda") is linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", DOWN_SHAPES)
def test_silu_and_mul_linear_real_shapes_every_m(shape, dtype):
    n, k = SHAPES[shape]
    w = weight(n, k, dtype)
    for m in range(1, MAX_ROWS + 1):
        x = rand(m, 2 * k, dtype=dtype, seed=m)
        got = silu_and_mul_linear(x, w)
        # The activation rounded to the model dtype, as the unfused ops round it; the
        # product in fp32.
        ref = F.linear(native_act.silu_and_mul(x).float(), w.float())
        assert got.dtype == dtype and got.shape == (m, n)
        assert rel_err(got, ref) < tolerance(dtype), (shape, m)


@pytest.mark.parametrize("shape", DOWN_SHAPES)
@pytest.mark.parametrize("m", [1, 4])
def test_silu_and_mul_linear_is_bitwise_the_unfused_pair(shape, m):
    n, k = SHAPES[shape]
    w = weight(n, k, torch.bfloat16)
    x = rand(m, 2 * k, dtype=torch.bfloat16)
    b = rand(n, dtype=torch.bfloat16, seed=2)
    assert torch.equal(silu_and_mul_linear(x, w, b), linear(silu_and_mul(x), w, b))


def test_silu_and_mul_linear_registered_for_cuda():
    assert resolve_op("silu_and_mul_linear", "cuda") is silu_and_mul_linear


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("experts", [128, 64])  # Qwen3-30B-A3B's and DeepSeek-V2-Lite's routers
def test_fp32_router_weight_promotes_x(experts, x_dtype):
    # Past MAX_ROWS the router's rows go in blocks (the FMA path), up to ROW_BLOCKS_MAX_ROWS.
    w = weight(experts, 2048, torch.float32)
    for m in [*range(1, MAX_ROWS + 1), 17, 24, 32, 48, 64, 100, ROW_BLOCKS_MAX_ROWS]:
        x = rand(m, 2048, dtype=x_dtype, seed=m)
        assert supported(x, w, None), m
        got = linear(x, w)
        assert got.dtype == torch.float32
        assert rel_err(got, F.linear(x.float(), w)) < tolerance(torch.float32), m
    assert not supported(rand(ROW_BLOCKS_MAX_ROWS + 1, 2048, dtype=x_dtype), w, None)


def test_fp32_router_graph_replay_equals_eager():
    w = weight(128, 2048, torch.float32)
    x = rand(32, 2048, dtype=torch.bfloat16)
    linear(x, w)  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w)
    x.copy_(rand(32, 2048, dtype=torch.bfloat16, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, linear(x, w))


NORM_SHAPES = ["qwen3-0.6b.qkv", "qwen3-0.6b.gate_up", "qwen3-8b.qkv", "qwen3-30b-a3b.qkv"]


def rms_ref(h: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_linear_real_shapes_every_m(shape, dtype):
    n, k = SHAPES[shape]
    w = weight(n, k, dtype)
    nw = (1 + 0.1 * rand(k, dtype=torch.float32, seed=9)).to(dtype)
    for m in range(1, MAX_ROWS + 1):
        x, res = rand(m, k, dtype=dtype, seed=m), rand(m, k, dtype=dtype, seed=100 + m)
        got, summed = rms_norm_linear(x, res, nw, 1e-6, w)
        ref_summed = (x.float() + res.float()).to(dtype)
        assert torch.equal(summed, ref_summed), (shape, m)
        # The product of the exact normalised x, in fp32 (the kernel does not round it first).
        ref = F.linear(rms_ref(ref_summed, nw), w.float())
        assert got.dtype == dtype and got.shape == (m, n)
        assert rel_err(got, ref) < tolerance(dtype), (shape, m)
        got, same = rms_norm_linear(x, None, nw, 1e-6, w)
        assert same is x
        ref = F.linear(rms_ref(x, nw), w.float())
        assert rel_err(got, ref) < tolerance(dtype), (shape, m)


def test_rms_norm_linear_graph_replay_equals_eager():
    n, k = SHAPES["qwen3-0.6b.qkv"]
    w = weight(n, k, torch.bfloat16)
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    x, res = rand(1, k, dtype=torch.bfloat16), rand(1, k, dtype=torch.bfloat16, seed=2)
    eager = rms_norm_linear(x, res, nw, 1e-6, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rms_norm_linear(x, res, nw, 1e-6, w)
    x.copy_(rand(1, k, dtype=torch.bfloat16, seed=3))
    graph.replay()
    want = rms_norm_linear(x, res, nw, 1e-6, w)
    assert torch.equal(captured[0], want[0]) and torch.equal(captured[1], want[1])
    assert not torch.equal(captured[0], eager[0])


def test_rms_norm_linear_registered_for_cuda():
    assert resolve_op("rms_norm_linear", "cuda") is rms_norm_linear
