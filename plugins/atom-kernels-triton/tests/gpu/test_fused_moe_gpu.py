"""The Triton fused_moe against the native reference on the GPU: dtypes, the real MoE
shapes at decode and prefill sizes, several block configs, CUDA-graph replay and
run-to-run determinism."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from atom_kernels_triton.fused_moe import fused_moe  # noqa: E402
from atom_kernels_triton.fused_moe_config import MoeConfig  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native.moe import fused_moe as native_fused_moe  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (experts, top_k, hidden, inter): a small one, Qwen3-30B-A3B and DeepSeek-V2-Lite.
SHAPES = {
    "small": (8, 2, 256, 96),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
}
_weights: dict = {}


def expert_weights(experts, hidden, inter, dtype):
    key = (experts, hidden, inter, dtype)
    if key not in _weights:
        _weights.clear()  # one shape's weights at a time (the real ones are GBs in fp32)
        g = torch.Generator(device="cuda").manual_seed(0)
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5
        w2 = torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter**0.5
        _weights[key] = (w13.to(dtype), w2.to(dtype))
    return _weights[key]


def routed(tokens, experts, top_k, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def inputs(shape, tokens, dtype, seed=1):
    experts, top_k, hidden, inter = SHAPES[shape]
    w13, w2 = expert_weights(experts, hidden, inter, dtype)
    x = torch.randn(tokens, hidden, device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(seed))
    weights, ids = routed(tokens, experts, top_k, seed)
    return x.to(dtype), w13, w2, weights, ids


def check(x, w13, w2, weights, ids, config=None):
    got = fused_moe(x, w13, w2, weights, ids, config=config)
    ref = native_fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == ref.dtype
    assert rel_err(got, ref) < tolerance(x.dtype)
    return got


def test_registered_for_cuda():
    assert "triton" in resolve_op("fused_moe", "cuda").__module__


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 32, 256])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_native(dtype, tokens, shape):
    check(*inputs(shape, tokens, dtype))


@pytest.mark.parametrize("tokens", [1500, 2048, 8192])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "deepseek-v2-lite"])
def test_prefill_sizes_match_native(tokens, shape):
    """Prefill batches run the table's tuned prefill tiles (Qwen3-30B-A3B's 128 x 128) or
    the heuristic's, whichever get_config picks."""
    check(*inputs(shape, tokens, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "deepseek-v2-lite"])
def test_out_of_range_ids(dtype, shape):
    # Expert parallelism: ids another rank owns arrive as -1 (or >= E); they add nothing.
    x, w13, w2, weights, ids = inputs(shape, 64, dtype)
    ids = ids.clone()
    ids[::3, 0] = -1
    ids[1::5, -1] = w13.shape[0]
    ids[7] = -1
    got = check(x, w13, w2, weights, ids)
    assert not got[7].any()


def test_skewed_load():
    # Every token on the same few experts: one long segment, most experts idle.
    x, w13, w2, weights, ids = inputs("qwen3-30b-a3b", 256, torch.bfloat16)
    ids = torch.arange(8, device="cuda").expand(256, 8).contiguous()
    check(x, w13, w2, weights, ids)


@pytest.mark.parametrize(
    "config",
    [
        MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2),
        MoeConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
        MoeConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
        MoeConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2),
    ],
    ids=lambda c: "M{BLOCK_M}N{BLOCK_N}K{BLOCK_K}w{num_warps}s{num_stages}".format(**c),
)
@pytest.mark.parametrize("tokens", [1, 256])
def test_block_configs(config, tokens):
    check(*inputs("deepseek-v2-lite", tokens, torch.bfloat16), config=config)


def test_deterministic():
    args = inputs("qwen3-30b-a3b", 256, torch.bfloat16)
    assert torch.equal(fused_moe(*args), fused_moe(*args))


@pytest.mark.parametrize("tokens", [1, 32, 128, 300])
@pytest.mark.parametrize("shape,shared", [("qwen3-30b-a3b", 0), ("deepseek-v2-lite", 2)])
def test_cuda_graph_replay(tokens, shape, shared):
    """Captured once, replayed with other routing: the alignment must not read the device
    from the host (capture would fail) nor bake the capture-time routing in. 300 tokens
    (> moe_align.SMALL_PAIRS pairs) take the torch alignment, which for DeepSeek's shared
    experts also builds their ids inside the graph."""
    from atom_core.ops.native.moe import with_shared_experts

    x, w13, w2, weights, ids = inputs(shape, tokens, torch.bfloat16)
    experts = w13.shape[0]
    if shared:  # the last ``shared`` of the stacked experts, as DeepSeek's FusedMoE holds them
        w13, w2 = expert_weights(experts + shared, x.shape[1], w2.shape[2], torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared)
    for seed in (2, 3):
        nx, _, _, nweights, nids = inputs(shape, tokens, torch.bfloat16, seed=seed)
        nids[0, 0] = -1
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        graph.replay()
        ref = native_fused_moe(x, w13, w2, *with_shared_experts(weights, ids, w13.shape[0], shared))
        assert rel_err(out, ref) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 32, 256])
def test_shared_experts_as_implicit_slots(dtype, tokens):
    """DeepSeek-V2-Lite's layout: 64 routed experts and 2 shared ones stacked after them,
    which every token takes with weight 1.0 without their ids being in topk_ids."""
    from atom_core.ops.native.moe import with_shared_experts

    experts, top_k, hidden, inter = 66, 6, 2048, 1408
    w13, w2 = expert_weights(experts, hidden, inter, dtype)
    x = torch.randn(tokens, hidden, device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(1))
    x = x.to(dtype)
    weights, ids = routed(tokens, 64, top_k)
    got = fused_moe(x, w13, w2, weights, ids, num_shared_experts=2)
    full_weights, full_ids = with_shared_experts(weights, ids, experts, 2)
    assert torch.equal(got, fused_moe(x, w13, w2, full_weights, full_ids))
    assert rel_err(got, native_fused_moe(x, w13, w2, full_weights, full_ids)) < tolerance(dtype)


def counted_inputs(shape, tokens, shared):
    """Inputs at the shape's real sizes, ``shared`` shared experts stacked after the routed
    ones, and the table's config for them."""
    from atom_kernels_triton.fused_moe_config import get_config

    x, w13, w2, weights, ids = inputs(shape, tokens, torch.bfloat16)
    if shared:
        w13, w2 = expert_weights(w13.shape[0] + shared, x.shape[1], w2.shape[2], torch.bfloat16)
    return x, w13, w2, weights, ids, get_config(tokens, ids.shape[1] + shared, w13.shape[0],
                                                x.shape[1], w2.shape[2])


@pytest.mark.parametrize("per_sm", [1, 3, 64])  # 64: capped by the occupancy
@pytest.mark.parametrize("tokens", [1, 16, 32, 64])
@pytest.mark.parametrize("shape,shared", [("qwen3-30b-a3b", 0), ("deepseek-v2-lite", 2)])
def test_persistent_launch_equals_two_launches(per_sm, tokens, shape, shared):
    """Both GEMMs in one launch, its programs waiting on one another's gate/up tiles: bitwise
    the two launches' output, run after run (a missed wait would read a stale intermediate)."""
    x, w13, w2, weights, ids, base = counted_inputs(shape, tokens, shared)
    ids[0, 0] = -1
    plain = MoeConfig({**base, "PERSISTENT": 0, "OVERLAP": False})
    two = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=plain)
    config = MoeConfig({**base, "PERSISTENT": per_sm})
    for _ in range(20):
        assert torch.equal(fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared,
                                     config=config), two)


@pytest.mark.parametrize("tokens", [16, 32, 64])  # at 2-4 tokens the grid fits: no overlap
@pytest.mark.parametrize("shape,shared", [("qwen3-30b-a3b", 0), ("deepseek-v2-lite", 2)])
def test_overlapped_down_launch_equals_two_launches(monkeypatch, tokens, shape, shared):
    """Down tiles waiting on their own block's gate/up tiles (PDL on, no wait for the whole
    gate/up launch): bitwise the plain launches' output, 20 launches back to back on one
    stream, each reusing the last one's buffers (a missed wait would read a stale or
    half-written intermediate)."""
    from test_fused_moe_triton import _down_launches

    x, w13, w2, weights, ids, base = counted_inputs(shape, tokens, shared)
    ids[0, 0] = -1
    plain = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared,
                      config=MoeConfig({**base, "OVERLAP": False}))
    seen = _down_launches(monkeypatch)
    config = MoeConfig({**base, "OVERLAP": True})
    outs = [fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared,
                      config=config) for _ in range(20)]
    assert seen == [(tokens, True)] * 20  # these grids are past twice the resident programs
    for out in outs:
        assert torch.equal(out, plain)


@pytest.mark.parametrize("variant", [("PERSISTENT", 4), ("OVERLAP", True)],
                         ids=["persistent", "overlap"])
@pytest.mark.parametrize("shape,shared", [("qwen3-30b-a3b", 0), ("deepseek-v2-lite", 2)])
def test_counted_launches_in_a_graph(variant, shape, shared):
    """Two layers' worth, the second reading the first's output, replayed with new routing
    each time: the alignment re-zeroes the block counts every launch, so no launch sees the
    one before's."""
    x, w13, w2, weights, ids, base = counted_inputs(shape, 32, shared)
    key, on = variant
    config = MoeConfig({**base, key: on})
    plain = MoeConfig({**base, "PERSISTENT": 0, "OVERLAP": False})
    fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mid = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=config)
        out = fused_moe(mid, w13, w2, weights, ids, num_shared_experts=shared, config=config)
    for seed in range(2, 12):
        nx, _, _, nweights, nids = inputs(shape, 32, torch.bfloat16, seed=seed)
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        graph.replay()
        want = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=plain)
        want = fused_moe(want, w13, w2, weights, ids, num_shared_experts=shared, config=plain)
        assert torch.equal(out, want)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v2-lite"])
def test_overlap_keeps_the_models_greedy_tokens(tmp_path, monkeypatch, name):
    """The real models' shapes cut to two layers (DeepSeek-V2-Lite: one dense, one MoE),
    random weights, 32 sequences decoded from CUDA graphs: the same greedy tokens with the
    overlapped down launch as with the plain wait, and the overlap is really taken."""
    import json
    import random
    from pathlib import Path

    from atom_kernels_triton import fused_moe_config, tuning
    from test_fused_moe_triton import _down_launches

    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    config = Path(__file__).parents[4] / "bench" / "configs" / name / "config.json"
    if not config.is_file():
        pytest.skip("needs the repository's bench/configs")
    cfg = json.loads(config.read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg["vocab_size"]) for _ in range(rng.randrange(20, 200))]
               for _ in range(32)]
    shape = (cfg["hidden_size"], cfg["moe_intermediate_size"])

    def greedy(overlap: bool) -> list[list[int]]:
        per_bucket = fused_moe_config.tuned(tuning.device_name())[shape]
        monkeypatch.setitem(per_bucket, 32, MoeConfig({**per_bucket[32], "OVERLAP": overlap}))
        engine = LLMEngine(str(tmp_path), load_dummy="empty", dtype="bfloat16", device="cuda",
                           enable_log_stats=False, max_model_len=512, max_num_seqs=32,
                           cudagraph_capture_sizes=[8, 16, 32])
        torch.manual_seed(0)
        with torch.no_grad():
            for p in engine.runner.model.parameters():
                p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        tokens = [o["token_ids"] for o in engine.generate(prompts, params)]
        del engine
        torch.cuda.empty_cache()
        return tokens

    plain = greedy(False)
    seen = _down_launches(monkeypatch)
    assert greedy(True) == plain
    # Every 16-32-token step (graph captures of 16 and 32, decode) took the overlap (the
    # op's own test shows these grids past twice the resident programs); prefill sizes, whose
    # buckets lack OVERLAP, did not.
    assert (32, True) in seen
    assert all(overlap for tokens, overlap in seen if 16 <= tokens <= 32)
    assert not any(overlap for tokens, overlap in seen if tokens > 32)
