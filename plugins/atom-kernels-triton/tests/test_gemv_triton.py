"""The Triton ``linear`` (skinny GEMM) against F.linear, and ``silu_and_mul_linear`` and
``rms_norm_linear`` (the same kernel with the activation or the norm fused into its x
loads) against the native ops, on CPU through TRITON_INTERPRET=1
with small shapes (tests/gpu/test_gemv_gpu.py runs the real ones). Skipped where triton is
not installed."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from atom_kernels_triton import gemv, gemv_config, tuning  # noqa: E402
from atom_kernels_triton.activation import silu_and_mul  # noqa: E402
from atom_kernels_triton.gemv import linear, rms_norm_linear, silu_and_mul_linear  # noqa: E402
from atom_kernels_triton.gemv_config import GemvConfig, default_config, get_config  # noqa: E402
from atom_kernels_triton.hooks import triton_ops  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native import activation as native_act  # noqa: E402
from atom_core.ops.native import linear as native_linear_mod  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# N and K off every block size below; BLOCK_K 32 < K exercises the K loop and its tail.
N, K = 70, 200
SMALL = GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
SPLIT = GemvConfig(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)


def table() -> gemv_config.GemvTable:
    """The table this device's launches read (empty on CPU: a test puts entries in)."""
    return tuning.table_for(gemv_config.OP, torch.device(DEVICE))


def shipped_tables() -> list[str]:
    """The devices with a table in the package."""
    paths = sorted((tuning.CONFIG_DIR / gemv_config.OP).glob("*.json"))
    return [json.loads(p.read_text())["device"] for p in paths]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def dtypes_for(m: int) -> list[torch.dtype]:
    # The interpreter's tl.dot reads bf16 operands as raw bits, so the M > 1 (tl.dot)
    # path is checked in bf16 by tests/gpu only; the M == 1 path does no tl.dot.
    if m > 1 and DEVICE == "cpu":
        return [torch.float32, torch.float16]
    return [torch.float32, torch.float16, torch.bfloat16]


def reference(x, w, b):
    """F.linear in fp32 on the same (rounded) inputs."""
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def check(x, w, b, config):
    out = linear(x, w, b, config=config)
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], w.shape[0])
    # fp32 runs tl.dot in ieee precision and the 1-row path in fp32 FMAs: fp32-tight.
    assert rel_err(out, reference(x, w, b)) < tolerance(x.dtype)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["no-split", "split-k"])
@pytest.mark.parametrize("has_bias", [False, True])
def test_matches_f_linear(m, config, has_bias):
    for dtype in dtypes_for(m):
        x, w = rand(m, K, dtype=dtype), rand(N, K, dtype=dtype, seed=1)
        b = rand(N, dtype=dtype, seed=2) if has_bias else None
        check(x, w, b, config)


def test_every_row_count_up_to_the_threshold():
    w, b = rand(N, K, seed=1), rand(N, seed=2)
    for m in range(1, gemv.MAX_ROWS + 1):
        check(rand(m, K, seed=m), w, b, SPLIT)


def test_three_d_input_and_default_config():
    x, w, b = rand(2, 3, K), rand(N, K, seed=1), rand(N, seed=2)
    out = linear(x, w, b)
    assert out.shape == (2, 3, N)
    assert rel_err(out, reference(x, w, b)) < tolerance(torch.float32)


def test_strided_rows_of_x():
    # x a column slice of a wider tensor (rows not contiguous with each other).
    x, w = rand(4, 2 * K)[:, :K], rand(N, K, seed=1)
    check(x, w, None, SMALL)


def test_split_k_is_bitwise_reproducible():
    x, w, b = rand(3, K), rand(N, K, seed=1), rand(N, seed=2)
    assert torch.equal(linear(x, w, b, config=SPLIT), linear(x, w, b, config=SPLIT))


def test_split_past_k_is_dropped():
    # 7 chunks of 32 cannot be split 8 ways into whole chunks: the launch uses 7.
    x, w = rand(1, K), rand(N, K, seed=1)
    check(x, w, None, GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=8, num_warps=4, num_stages=2))


@pytest.mark.parametrize(
    "case",
    ["many-rows", "strided-weight", "dtype-mismatch", "no-rows", "int"],
)
def test_falls_back_to_f_linear(case, monkeypatch):
    x, w, b = rand(gemv.MAX_ROWS + 1, K), rand(N, K, seed=1), rand(N, seed=2)
    if case == "many-rows":  # past MAX_ROWS with a weight above the small-weight bound
        monkeypatch.setattr(gemv, "ROW_BLOCKS_MAX_WEIGHT_BYTES", w.numel() * w.element_size() - 1)
    elif case == "strided-weight":
        x, w = x[:2], rand(K, N, seed=1).t()
    elif case == "dtype-mismatch":  # only an fp32 weight takes another x dtype
        x, w, b = x[:2], w.half(), None
    elif case == "no-rows":
        x = x[:0]
    elif case == "int":
        x, w, b = x[:2].to(torch.int64), w.to(torch.int64), None
    assert not gemv.supported(x, w, b)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel ran on a shape it does not serve")

    monkeypatch.setattr(gemv, "_gemv_kernel", no_kernel)
    if case == "dtype-mismatch":  # F.linear's own error, not a silent cast
        with pytest.raises(RuntimeError, match="dtype"):
            linear(x, w, b)
        return
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("m", [17, 32, 40])
@pytest.mark.parametrize("config", [SMALL, SPLIT, None], ids=["no-split", "split-k", "default"])
def test_row_blocks_past_max_rows_for_a_small_weight(m, config):
    # Rows in blocks of MAX_ROWS on a third grid axis (40: a partial last block), each
    # block writing only its own rows, also through the split-K reduce.
    x, w, b = rand(m, K, seed=m), rand(N, K, seed=1), rand(N, seed=2)
    assert gemv.supported(x, w, b)
    check(x, w, b, config)
    check(x.half(), w.half(), b.half(), config)


class _RecordBlockM:
    """Stands in for ``gemv._gemv_kernel``: runs it, noting each launch's BLOCK_M."""

    def __init__(self):
        self.kernel, self.block_m = gemv._gemv_kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.block_m.append(kwargs["BLOCK_M"])
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("m", [17, 24, 32])
@pytest.mark.parametrize("split", [1, 3])
def test_wide_rows_run_one_32_row_tile_where_the_table_has_one(m, split, monkeypatch):
    # 17..32 rows of a 16-bit W too big for row blocks: one 32-row tile (rows past m masked),
    # also through the split-K reduce, for a shape whose table has a WIDE_ROWS entry.
    wide = GemvConfig(BLOCK_N=32, BLOCK_K=32, SPLIT_K=split, num_warps=4, num_stages=2)
    monkeypatch.setitem(table(), (N, K), {16: SMALL, gemv_config.WIDE_ROWS: wide})
    monkeypatch.setattr(gemv, "ROW_BLOCKS_MAX_WEIGHT_BYTES", 0)
    x, w = rand(m, K, dtype=torch.float16, seed=m), rand(N, K, dtype=torch.float16, seed=1)
    assert gemv.supported(x, w, None) and get_config(m, N, K, 2) is wide
    record = _RecordBlockM()
    monkeypatch.setattr(gemv, "_gemv_kernel", record)
    out = linear(x, w)
    assert record.block_m == [gemv_config.WIDE_ROWS]
    assert rel_err(out, reference(x, w, None)) < tolerance(torch.float16)


def test_wide_rows_stop_at_their_bounds(monkeypatch):
    wide = GemvConfig(BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
    monkeypatch.setitem(table(), (N, K), {16: SMALL, gemv_config.WIDE_ROWS: wide})
    monkeypatch.setattr(gemv, "ROW_BLOCKS_MAX_WEIGHT_BYTES", 0)
    w = rand(N, K, dtype=torch.float16, seed=1)
    assert gemv.supported(rand(gemv_config.WIDE_ROWS, K, dtype=torch.float16), w, None)
    assert not gemv.supported(rand(gemv_config.WIDE_ROWS + 1, K, dtype=torch.float16), w, None)
    assert not gemv.supported(rand(17, K), w.float(), None)  # 16-bit weights only
    assert get_config(16, N, K, 2) is SMALL  # 16 rows keep their own bucket
    monkeypatch.setitem(table(), (N, K), {16: SMALL})
    assert not gemv.supported(rand(17, K, dtype=torch.float16), w, None)  # no entry: cuBLAS
    assert get_config(17, N, K, 2) is SMALL  # as before for a small weight's row blocks


def test_row_blocks_stop_at_their_bounds(monkeypatch):
    w = rand(N, K, seed=1)
    assert gemv.supported(rand(gemv_config.ROW_BLOCKS_MAX_ROWS, K), w, None)
    assert not gemv.supported(rand(gemv_config.ROW_BLOCKS_MAX_ROWS + 1, K), w, None)
    # The fused forms stay one-row whatever the weight's size.
    assert not gemv.supported(rand(2, 2 * K), w, None, gated=True)
    assert not gemv.supported(rand(17, K), w, None, fused=True)
    # The shipped bound: both MoE routers' fp32 gates are in, the smallest bf16 projection of
    # the benchmarked models (DeepSeek-V2-Lite's kv_a_proj, 576 x 2048) is out.
    def nbytes(n, k, dtype):
        return n * k * torch.tensor([], dtype=dtype).element_size()

    assert nbytes(128, 2048, torch.float32) <= gemv_config.ROW_BLOCKS_MAX_WEIGHT_BYTES
    assert nbytes(64, 2048, torch.float32) <= gemv_config.ROW_BLOCKS_MAX_WEIGHT_BYTES
    assert nbytes(576, 2048, torch.bfloat16) > gemv_config.ROW_BLOCKS_MAX_WEIGHT_BYTES


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16, 32])
def test_fp32_weight_promotes_a_half_precision_x(m, x_dtype):
    # The MoE router: fp32 weight, model-dtype hidden states, fp32 logits in one kernel.
    x, w = rand(m, K, dtype=x_dtype, seed=m), rand(N, K, seed=1)
    assert gemv.supported(x, w, None)
    for config in (SMALL, SPLIT):
        got = linear(x, w, config=config)
        assert got.dtype == torch.float32
        assert rel_err(got, F.linear(x.float(), w)) < tolerance(torch.float32)
    native = resolve_op("linear", "cpu")
    assert torch.equal(native(x.cpu(), w.cpu()), F.linear(x.cpu().float(), w.cpu()))


def test_default_config_fills_the_gpu():
    sms = 132
    # (N, K): Qwen3-0.6B qkv, o_proj, gate_up, down; Qwen3-8B o_proj; the 0.6B LM head.
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 4096),
                 (151936, 1024)]:
        for m in (1, 2, 16):
            c = default_config(m, n, k, 2, sms)
            programs = -(-n // c["BLOCK_N"]) * c["SPLIT_K"]
            assert programs >= 2 * sms or c["SPLIT_K"] > 1, (n, k, m, c)
            assert c["BLOCK_N"] >= (4 if m == 1 else 16)  # tl.dot needs 16
            assert -(-k // c["BLOCK_K"]) >= 2 * c["SPLIT_K"] or c["SPLIT_K"] == 1
    assert default_config(1, 1024, 3072, 2, sms)["SPLIT_K"] > 1  # down_proj: few features
    assert default_config(1, 151936, 1024, 2, sms)["SPLIT_K"] == 1


def test_fma_config_for_fp32_weights_on_several_rows():
    sms = 132
    # The sweep's fastest for Qwen3-30B-A3B's router (128 x 2048) at 8, 32 and 128 rows.
    def pick(m, n=128, k=2048):
        c = default_config(m, n, k, 4, sms)
        return c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]

    assert pick(8) == (4, 256, 4)
    assert pick(32) == (4, 256, 4)
    assert pick(128) == (4, 256, 1)
    # Any shape: the fp32 tile fits 128 values a thread, and K splits stay >= 2 chunks.
    for m in (2, 3, 8, 16, 17, 64, 128):
        for n, k in [(64, 2048), (128, 2048), (160, 5120), (151936, 1024), (70, 200)]:
            c = default_config(m, n, k, 4, sms)
            rows = min(16, 1 << (m - 1).bit_length())
            assert rows * c["BLOCK_N"] * c["BLOCK_K"] <= 128 * 128, (m, n, k, c)
            assert -(-k // c["BLOCK_K"]) >= 2 * c["SPLIT_K"] or c["SPLIT_K"] == 1


def test_tuned_table_wins_by_nearest_bucket(monkeypatch):
    tuned = {2: SMALL, 8: SPLIT}
    monkeypatch.setitem(table(), (N, K), tuned)
    assert get_config(1, N, K, 2) is SMALL
    assert get_config(3, N, K, 2) is SPLIT
    assert get_config(16, N, K, 2) is SPLIT
    assert get_config(1, N + 1, K, 2) == default_config(1, N + 1, K, 2)
    # The table was measured on 2-byte weights: fp32 gets the heuristic.
    assert get_config(1, N, K, 4) == default_config(1, N, K, 4)


def test_tuned_none_calls_cublas(monkeypatch):
    # A bucket measured slower than cuBLAS is None: the op must not launch the kernel.
    monkeypatch.setitem(table(), (N, K), {1: None, 16: SMALL})
    x, w = rand(1, K, dtype=torch.float16), rand(N, K, dtype=torch.float16, seed=1)

    class NoKernel:  # launched as kernel[grid](...)
        def __getitem__(self, grid):
            raise AssertionError("the kernel ran where the table says cuBLAS")

    monkeypatch.setattr(gemv, "_gemv_kernel", NoKernel())
    assert torch.equal(linear(x, w), F.linear(x, w))
    with pytest.raises(AssertionError, match="table says cuBLAS"):
        linear(rand(4, K, dtype=torch.float16), w)  # bucket 16 has a config: the kernel runs


@pytest.mark.parametrize("device", shipped_tables())
def test_shipped_table_is_well_formed(device):
    for (n, k), per_m in gemv_config.tuned(device).items():
        assert set(per_m) <= {1, 2, 4, 8, 16, gemv_config.WIDE_ROWS}, (n, k)
        for m, c in per_m.items():
            if c is None:
                continue
            # tl.dot (the path for 2+ rows) needs BLOCK_N >= 16; tiles are powers of two. A
            # split count need not be (3 x 1024 spans a 3072-wide K whole). The 32-row tiles
            # (gemv_config.WIDE_ROWS) were checked in the model.
            widths = {1: (4, 8, 16, 32, 64), gemv_config.WIDE_ROWS: (32, 64, 128)}
            widths = widths.get(m, (16, 32, 64))
            assert c["BLOCK_N"] in widths, (n, k, m, c)
            in_model = tuning.in_model(gemv_config.OP, device)
            assert m != gemv_config.WIDE_ROWS or (n, k, m) in in_model
            assert c["BLOCK_K"] & (c["BLOCK_K"] - 1) == 0 and 1 <= c["SPLIT_K"] <= 8, (n, k, m, c)
            # No split starts past K (the launch would drop it: the entry would not be what runs).
            last_start = (c["SPLIT_K"] - 1) * -(-k // (c["SPLIT_K"] * c["BLOCK_K"])) * c["BLOCK_K"]
            assert last_start < k, (n, k, m, c)


def test_whole_k_entries_cover_each_split_in_one_tile():
    # The one-row entries that load a program's whole W slice before the PDL wait.
    for n, k in [(1024, 2048), (1024, 3072), (6144, 1024), (4096, 1024)]:
        c = gemv_config.tuned("NVIDIA H200")[(n, k)][1]
        assert c["BLOCK_K"] * c["SPLIT_K"] >= k and c["BLOCK_K"] * (c["SPLIT_K"] - 1) < k, (n, k, c)
        # What is checked lies along K; a few output tiles (one ragged) stand for all n
        # (the interpreter's time grows with the programs: all of n took ~40 s).
        x, w = rand(1, k, seed=3), rand(2 * c["BLOCK_N"] + 1, k, seed=4)
        assert rel_err(linear(x, w, config=c), reference(x, w, None)) < tolerance(torch.float32)


def test_registered_as_linear():
    from atom_core.ops.native.linear import linear as native_linear

    assert resolve_op("linear", "cpu") is native_linear


# silu_and_mul_linear: x is gate | up, 2 * KG wide, KG off every block size.
KG = 777


def gated_config(split_k: int) -> GemvConfig:
    return GemvConfig(BLOCK_N=16, BLOCK_K=128, SPLIT_K=split_k, num_warps=4, num_stages=2)


class FusedLaunchForbidden:
    """Stands in for ``_gemv_kernel``: launches a plain product, raises on a fused one."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs["GATED"] or kwargs["NORM"]:
                raise AssertionError("the fused kernel ran on a call it does not serve")
            return REAL_KERNEL[grid](*args, **kwargs)

        return launch


REAL_KERNEL = gemv._gemv_kernel


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("has_bias", [False, True])
def test_silu_and_mul_linear_matches_native(m, split_k, has_bias):
    x, w = rand(m, 2 * KG), rand(N, KG, seed=1)
    b = rand(N, seed=2) if has_bias else None
    config = gated_config(split_k)
    out = silu_and_mul_linear(x, w, b, config=config)
    assert out.shape == (m, N)
    assert rel_err(out, native_act.silu_and_mul_linear(x, w, b)) < tolerance(torch.float32)
    assert torch.equal(out, linear(silu_and_mul(x), w, b, config=config))


@pytest.mark.parametrize("m", [1, 3])
def test_silu_and_mul_linear_is_bitwise_the_unfused_path(m):
    # Half precision too: silu and the product are each rounded to the model dtype, as
    # silu_and_mul rounds them, or the bits differ.
    for dtype in dtypes_for(m):
        x, w = rand(m, 2 * KG, dtype=dtype), rand(N, KG, dtype=dtype, seed=1)
        b = rand(N, dtype=dtype, seed=2)
        config = gated_config(4)
        out = silu_and_mul_linear(x, w, b, config=config)
        assert torch.equal(out, linear(silu_and_mul(x), w, b, config=config)), dtype


def test_silu_and_mul_linear_strided_and_3d_input():
    w, b = rand(N, KG, seed=1), rand(N, seed=2)
    # Rows of a wider tensor: the up half is K past the gate in a row, not a row stride on.
    x = rand(4, 3 * KG)[:, : 2 * KG]
    out = silu_and_mul_linear(x, w, b, config=gated_config(1))
    assert rel_err(out, native_act.silu_and_mul_linear(x, w, b)) < tolerance(torch.float32)
    x = rand(2, 3, 2 * KG, seed=3)
    out = silu_and_mul_linear(x, w, b)  # the default config
    assert out.shape == (2, 3, N)
    assert rel_err(out, native_act.silu_and_mul_linear(x, w, b)) < tolerance(torch.float32)


@pytest.mark.parametrize("case", ["two-rows", "past-max-rows", "cublas-bucket"])
def test_silu_and_mul_linear_falls_back_to_two_ops(case, monkeypatch):
    # The fused forms serve one row: from two on, the two ops (the kernel must not run).
    m = {"two-rows": 2, "past-max-rows": gemv.MAX_ROWS + 1, "cublas-bucket": 1}[case]
    x, w, b = rand(m, 2 * KG), rand(N, KG, seed=1), rand(N, seed=2)
    if case == "cublas-bucket":
        monkeypatch.setattr(gemv, "get_config", lambda *args: None)
    else:
        assert not gemv.supported(x, w, b, gated=True)
    monkeypatch.setattr(gemv, "_gemv_kernel", FusedLaunchForbidden())
    out = silu_and_mul_linear(x, w, b)
    assert torch.equal(out, linear(silu_and_mul(x), w, b))
    assert rel_err(out, native_act.silu_and_mul_linear(x, w, b)) < tolerance(torch.float32)


def test_silu_and_mul_linear_registered():
    assert resolve_op("silu_and_mul_linear", "cpu") is native_act.silu_and_mul_linear
    assert triton_ops()["silu_and_mul_linear"] is silu_and_mul_linear


# rms_norm_linear: the pre-norm block's norm folded into the GEMV's x loads.
def norm_inputs(m: int, k: int, dtype=torch.float32, residual: bool = True):
    x = rand(m, k, dtype=dtype, seed=3)
    res = rand(m, k, dtype=dtype, seed=4) if residual else None
    nw = (1 + 0.1 * rand(k, seed=5)).to(dtype)
    return x, res, nw, rand(N, k, dtype=dtype, seed=6), rand(N, dtype=dtype, seed=7)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_linear_matches_native(m, split_k, residual):
    x, res, nw, w, b = norm_inputs(m, KG, residual=residual)
    out, summed = rms_norm_linear(x, res, nw, 1e-6, w, b, config=gated_config(split_k))
    ref_out, ref_summed = native_linear_mod.rms_norm_linear(x, res, nw, 1e-6, w, b)
    assert out.shape == (m, N) and summed.shape == (m, KG)
    assert rel_err(out, ref_out) < tolerance(torch.float32)
    assert torch.equal(summed, ref_summed)
    if residual:
        assert summed.data_ptr() not in (x.data_ptr(), res.data_ptr())


@pytest.mark.parametrize("m", [1, 3])
def test_rms_norm_linear_half_precision(m):
    # The residual sum is rounded to the model dtype as the norm op rounds it (bit-exact);
    # the product is formed from x * g and scaled after (within the dtype's tolerance).
    # (fp16 only on CPU: the interpreter does not round to bf16 as the GPU does.)
    for dtype in dtypes_for(2)[1:]:
        x, res, nw, w, b = norm_inputs(m, KG, dtype=dtype)
        out, summed = rms_norm_linear(x, res, nw, 1e-6, w, b, config=gated_config(2))
        ref_out, ref_summed = native_linear_mod.rms_norm_linear(x, res, nw, 1e-6, w, b)
        assert torch.equal(summed, ref_summed), dtype
        assert rel_err(out, ref_out) < tolerance(dtype), dtype


def test_rms_norm_linear_default_config_3d_input():
    # A long row (the default config splits K), as a 3-D input.
    x, res, nw, w, b = norm_inputs(1, 4500)
    x, res = x.view(1, 1, -1), res.view(1, 1, -1)
    out, summed = rms_norm_linear(x, res, nw, 1e-6, w, b)
    ref_out, ref_summed = native_linear_mod.rms_norm_linear(x, res, nw, 1e-6, w, b)
    assert out.shape == (1, 1, N) and torch.equal(summed, ref_summed)
    assert rel_err(out, ref_out) < tolerance(torch.float32)


@pytest.mark.parametrize("case", ["two-rows", "past-max-rows", "cublas-bucket", "strided-row"])
def test_rms_norm_linear_fallbacks_and_strided_rows(case, monkeypatch):
    # two-rows, past-max-rows and cublas-bucket must take the norm op and ``linear`` (a
    # fused launch raises); strided-row is served by the fused kernel.
    m = {"two-rows": 2, "past-max-rows": gemv.MAX_ROWS + 1}.get(case, 1)
    x, res, nw, w, b = norm_inputs(m, KG)
    if case == "strided-row":
        # Served by the kernel: a row of a wider tensor.
        x = rand(m, 2 * KG, seed=3)[:, :KG]
    elif case == "cublas-bucket":
        monkeypatch.setattr(gemv, "get_config", lambda *args: None)
        monkeypatch.setattr(gemv, "_gemv_kernel", FusedLaunchForbidden())
    else:
        monkeypatch.setattr(gemv, "_gemv_kernel", FusedLaunchForbidden())
    out, summed = rms_norm_linear(x, res, nw, 1e-6, w, b)
    ref_out, ref_summed = native_linear_mod.rms_norm_linear(x, res, nw, 1e-6, w, b)
    assert torch.equal(summed, ref_summed)
    assert rel_err(out, ref_out) < tolerance(torch.float32)


def test_rms_norm_linear_registered():
    assert resolve_op("rms_norm_linear", "cpu") is native_linear_mod.rms_norm_linear
    assert triton_ops()["rms_norm_linear"] is rms_norm_linear
