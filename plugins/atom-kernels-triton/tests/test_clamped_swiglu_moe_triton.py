"""The Triton clamped_swiglu_moe (gpt-oss's experts) against the core's reference, on CPU
through TRITON_INTERPRET=1 with tiny shapes: model-dtype and MXFP4 stacks, with and
without biases, top_k 1-4, 1-40 tokens, out-of-range ids; the MXFP4 tile decode code by
code and scale by scale; and the tiny gpt-oss model's logits through either op.

Tolerances: ``triton_reference.tolerance`` on the relative Frobenius error of the output
(1e-5 fp32, 2e-3 fp16, 1.6e-2 bf16): both sides see the same weights (MXFP4 decodes exactly)
and round where the reference does, so they differ by fp32 accumulation order. The model's
logits within 1e-4 absolute (fp32). bf16 runs only where a GPU runs the kernels."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from atom_kernels_triton import clamped_swiglu_moe as csm  # noqa: E402
from atom_kernels_triton import hooks  # noqa: E402
from atom_kernels_triton.clamped_swiglu_moe import clamped_swiglu_moe, mxfp4_tile  # noqa: E402
from atom_kernels_triton.fused_moe_config import MoeConfig  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.native.clamped_swiglu_moe import (  # noqa: E402
    clamped_swiglu_moe as reference,
)
from atom_core.plugins import reset_plugins  # noqa: E402
from atom_core.quant.mxfp4 import FP4_VALUES, Mxfp4Weight, dequantize, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# BLOCK_K 32 (one scale group) below H and I: the K loop runs, and with H = 96 its last
# tile is half past the end; BLOCK_N 32 splits I = 64 into two tiles, H = 96 into three.
TINY = MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
HIDDEN, INTER, EXPERTS = 96, 64, 6
ALPHA, LIMIT = 1.702, 1.0  # gpt-oss's alpha; a limit the activations cross often
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def skip_bf16_on_cpu(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's tl.dot reads bf16 operands as raw bits; tests/gpu "
                    "covers bf16")


def moe_case(tokens, top_k, dtype, mxfp4, biases=(True, True), seed=0):
    """(hidden, w13, w13_bias, w2, w2_bias, topk_weights, topk_ids) on DEVICE; biases large
    enough to move the activation across the clamp."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=g) * 0.5 if biases[0] else None
    b2 = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5 if biases[1] else None
    weights = torch.rand(tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k] for _ in range(tokens)])

    def stack(w):
        if mxfp4:
            return Mxfp4Weight(*(t.to(DEVICE) for t in quantize(w)))
        return w.to(dtype).to(DEVICE)

    def on_device(t):
        return None if t is None else t.to(dtype).to(DEVICE)

    return (on_device(x), stack(w13), on_device(b13), stack(w2), on_device(b2),
            weights.to(DEVICE), ids.to(DEVICE))


def check(args, config=TINY):
    got = clamped_swiglu_moe(*args, ALPHA, LIMIT, config=config)
    ref = reference(*args, ALPHA, LIMIT)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = rel_err(got, ref)
    assert err < tolerance(ref.dtype), err
    return got, ref


def test_registered_for_gpus():
    assert hooks.triton_ops()["clamped_swiglu_moe"] is clamped_swiglu_moe


@pytest.mark.parametrize("mxfp4", [False, True], ids=["plain", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (2, 4), (9, 2), (17, 3),
                                          pytest.param(40, 4, marks=pytest.mark.slow)])
def test_matches_reference(tokens, top_k, dtype, mxfp4):
    skip_bf16_on_cpu(dtype)
    args = moe_case(tokens, top_k, dtype, mxfp4)
    _, ref = check(args)
    if tokens == 17:  # the clamp and the biases matter in these cases
        unclamped = reference(*args, ALPHA, 1e4)
        unbiased = reference(args[0], args[1], None, args[3], None, *args[5:], ALPHA, LIMIT)
        assert rel_err(unclamped, ref) > 0.1 and rel_err(unbiased, ref) > 0.1


@pytest.mark.parametrize("mxfp4", [False, True], ids=["plain", "mxfp4"])
@pytest.mark.parametrize("biases", [(False, False), (True, False), (False, True)],
                         ids=["none", "w13-only", "w2-only"])
def test_biases_may_be_none(biases, mxfp4):
    # w13 only: a tensor-parallel rank other than 0 (w2_bias None).
    check(moe_case(7, 3, torch.float16, mxfp4, biases=biases, seed=1))


def test_past_the_bound_still_weight_only():
    # No quantized-activation path: from bf16_bound tokens on, the same kernels run.
    x, w13, b13, w2, b2, weights, ids = moe_case(5, 2, torch.float16, mxfp4=True, seed=6)
    check((x, w13._replace(bf16_bound=1), b13, w2._replace(bf16_bound=1), b2, weights, ids))


def test_mxfp4_and_plain_stacks_mixed():
    x, w13, b13, w2, b2, weights, ids = moe_case(5, 2, torch.float32, mxfp4=True, seed=2)
    check((x, w13, b13, w2.dequantize(torch.float32), b2, weights, ids))
    check((x, w13.dequantize(torch.float32), b13, w2, b2, weights, ids))


@pytest.mark.parametrize("mxfp4", [False, True], ids=["plain", "mxfp4"])
def test_out_of_range_ids_add_nothing(mxfp4, monkeypatch):
    """Ids another rank owns (-1, E, past it) add nothing; a token with none is zero. The
    buffers are NaN-poisoned: no read of a row no program wrote (the intermediate's padding,
    the pairs without an expert) reaches the output."""
    x, w13, b13, w2, b2, weights, ids = moe_case(11, 3, torch.float32, mxfp4, seed=3)
    ids[0, 1], ids[3, 0], ids[5, 2] = -1, EXPERTS, 100
    ids[7] = -1
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    got, _ = check((x, w13, b13, w2, b2, weights, ids))
    assert not got[7].any()


def test_no_host_reads(monkeypatch):
    """The launch reads nothing of the device's tensors back (the reference's
    ``.unique().tolist()``), so a CUDA graph can capture it (tests/gpu captures one)."""
    args = moe_case(6, 2, torch.float32, mxfp4=True, seed=4)
    ref = reference(*args, ALPHA, LIMIT)

    def host_read(*_args, **_kwargs):
        raise AssertionError("a host read of a device tensor")

    for name in ("item", "tolist", "unique", "nonzero", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    got = clamped_swiglu_moe(*args, ALPHA, LIMIT, config=TINY)
    monkeypatch.undo()
    assert rel_err(got, ref) < tolerance(torch.float32)


def test_table_config_path():
    # No config: the op's table (none on CPU) falls back to fused_moe's heuristic, whose
    # BLOCK_K 128 spans all of H and I.
    check(moe_case(3, 2, torch.float32, mxfp4=True, seed=5), config=None)


# --- the MXFP4 tile decode ------------------------------------------------------------------


@triton.jit
def _decode_kernel(blocks_ptr, scales_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """out [N, K] = the weight, one [BLOCK_N, BLOCK_K] tile a program."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = mxfp4_tile(blocks_ptr, scales_ptr, K // 2, K // 32, rows, rows < N, k0, K, BLOCK_N,
                   BLOCK_K, DTYPE)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * K + kk[None, :], w, mask=(rows < N)[:, None])


# Over the normal fp32 range of every code (2**-126 .. 6 * 2**123), and 2**0.
SCALES = [2, 60, 100, 120, 126, 127, 128, 131, 190, 250]


# fp16: the largest scales overflow to inf, as the reference's cast does.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_mxfp4_decode_every_code_and_scale(dtype):
    """Each of the 256 bytes (all 16 codes in both nibbles, with every neighbour) under each
    scale, against FP4_VALUES[code] * 2**(scale - 127) computed here in Python floats."""
    rows, k = len(SCALES), 512
    byte = torch.arange(256, dtype=torch.uint8).repeat(rows, 1)  # [rows, K/2]
    scales = torch.tensor(SCALES, dtype=torch.uint8)[:, None].repeat(1, k // 32)
    scales[:, 1::2] = 127  # groups alternate with 2**0: each group keeps its own scale
    codes = torch.stack((byte & 0x0F, byte >> 4), dim=-1).reshape(rows, k)
    expected = torch.tensor(
        [[math.ldexp(FP4_VALUES[c], int(scales[r, i // 32]) - 127)
          for i, c in enumerate(codes[r].tolist())] for r in range(rows)],
        dtype=torch.float64,
    )
    out = torch.empty(rows, k, dtype=dtype, device=DEVICE)
    block_n, block_k = 16, 64
    tl_dtype = tl.float32 if dtype == torch.float32 else tl.float16
    _decode_kernel[(triton.cdiv(rows, block_n), k // block_k)](
        byte.to(DEVICE), scales.to(DEVICE), out, rows, k, BLOCK_N=block_n, BLOCK_K=block_k,
        DTYPE=tl_dtype,
    )
    out = out.cpu()
    assert torch.equal(out, expected.to(dtype))
    assert torch.equal(out, dequantize(byte, scales, dtype))
    # Signs too: code 8 is -0.0.
    assert torch.equal(out.signbit(), expected.signbit())


@triton.jit
def _scales_kernel(s_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, csm.e8m0_to_f32(tl.load(s_ptr + i).to(tl.int32)))


def test_e8m0_edges():
    """Scale 0 is 2**-127 (fp32's one denormal scale) and 255 overflows, as the reference's
    ldexp; 1 is 2**-126."""
    s = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    out = torch.empty(8, dtype=torch.float32, device=DEVICE)
    _scales_kernel[(1,)](torch.cat([s, s[:3]]).to(DEVICE), out, N=8)
    want = torch.ldexp(torch.ones(5), s.int() - 127)
    assert torch.equal(out[:5].cpu(), want)


# --- the tiny gpt-oss model ---------------------------------------------------------------

_GPTOSS_TESTS = Path(__file__).resolve().parents[2] / "atom-models-gptoss" / "tests"


@pytest.fixture
def triton_experts_on_cpu(monkeypatch):
    """Register the Triton clamped_swiglu_moe for the CPU (the interpreter runs it), and
    nothing else of the plugin."""
    monkeypatch.setattr(hooks, "unavailable_reason", lambda: None)
    monkeypatch.setattr(hooks, "DEVICE_KINDS", ("cpu", "cuda", "hip"))
    monkeypatch.setattr(hooks, "triton_ops", lambda: {"clamped_swiglu_moe": clamped_swiglu_moe})
    monkeypatch.setattr(hooks, "attention_backends", dict)
    reset_plugins()
    yield
    reset_plugins()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16", "mxfp4"])
def test_tiny_gptoss_logits_equal_reference(variant, triton_experts_on_cpu, monkeypatch):
    pytest.importorskip("atom_models_gptoss")
    pytest.importorskip("transformers")
    if not (_GPTOSS_TESTS / "tiny_gptoss.py").exists():
        pytest.skip("the gpt-oss plugin's tests (tiny_gptoss.py) are not in this checkout")
    monkeypatch.syspath_prepend(str(_GPTOSS_TESTS))
    from atom_models_gptoss.moe import GptOssExperts
    from tiny_gptoss import tiny_dir

    from atom_core.config import Config
    from atom_core.layers.context import forward_context
    from atom_core.loader import load_model
    from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches

    def run(op) -> list[torch.Tensor]:
        model = load_model(Config.from_kwargs(model=str(tiny_dir(variant))), "cpu",
                           torch.float32).model
        experts = [m for m in model.modules() if isinstance(m, GptOssExperts)]
        assert experts and all(e._op is op for e in experts)
        assert all(e.mxfp4 == (variant == "mxfp4") for e in experts)
        kv = PagedKV(num_blocks=32, block_size=4, seed=1)
        allocate_kv_caches(model, kv)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 272, (n,), generator=g).tolist() for n in (5, 11, 3)]
        ids = [kv.add_sequence() for _ in prompts]
        logits = []
        for new in [prompts, [[7], [8], [9]]]:  # prompts (19 tokens), then decodes
            meta, positions = kv.step(ids, [len(t) for t in new])
            flat = torch.tensor([t for chunk in new for t in chunk])
            with torch.no_grad(), forward_context(meta):
                logits.append(model.compute_logits(model(flat, positions)))
        return logits

    tri = run(clamped_swiglu_moe)
    monkeypatch.undo()  # the registry as it is on CPU: the reference only
    reset_plugins()
    ref = run(reference)
    for step, (a, b) in enumerate(zip(tri, ref)):
        assert (a - b).abs().max().item() < 1e-4, step
