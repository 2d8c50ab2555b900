"""FP8 linear layers (``--quantization fp8``) against bf16, by rows: where W8A8 overtakes the
weight-only product (``Fp8Weight.w8a8_min_rows``).

    python bench/fp8_linear.py [--model qwen3-8b] [--rows 1 4 16 32 64 128 256 512 1024 4096]
        [--calls 20] [--sweep [wonly] [w8a8]] [--json bench/results/fp8_linear.json]
    python bench/fp8_linear.py --dry-run    # CPU: the plan, and each path once, small

For each of the model's decoder projections (qkv, o, gate_up, down; not the LM head) and
each row count, four products, each timed as a CUDA graph of ``--calls`` back-to-back
calls that cycle through enough weight copies to overflow L2 (as a step's layers each read
their own weight), median replay:

- ``cuBLAS``: ``F.linear`` on the bf16 weight;
- ``bf16 op``: the Triton ``linear`` op on the bf16 weight (its GEMV where the table says,
  else cuBLAS: what a bf16 model runs today);
- ``fp8 w-only``: the ``linear`` op on an ``Fp8Weight`` whose ``w8a8_min_rows`` is never
  reached (the fp8 GEMV up to gemv_config.MAX_ROWS rows, the weight-only GEMM past it);
- ``fp8 w8a8``: the op on an ``Fp8Weight`` with ``w8a8_min_rows`` 1 (per-row quantization,
  then the product as the device's ``fp8_w8a8`` table routes it: fp8_gemm's Triton GEMM on
  e4m3 operands where it lists the shape and rows, else ``torch._scaled_mm``);
- ``scaled_mm``: the per-row quantization and ``torch._scaled_mm`` at every row count, with
  the op's fast accumulation (``fp8_gemm.SCALED_MM_FAST_ACCUM``); ``scaled_exact``: the same
  with cuBLAS's fp32 promotion of the sums instead; and ``quant``: the quantization kernel
  alone.

The projections a pre-norm block's norm feeds (qkv, gate_up) also time that norm (with the
residual add) and the W8A8 product together, on the line under theirs: as two ops
(``fused_add_rms_norm``, then ``linear``: the norm's rows written in bf16 and quantized by
a second kernel) and as ``rms_norm_linear`` (the norm and the quantization in one kernel,
``rms_norm_quant_fp8``, then ``torch._scaled_mm``); and the two kernels before the GEMM
against the one, with the fused kernel's TB/s (x and the residual read, the sum and the
e4m3 rows written).

Each in us, with TB/s (weight + x + output bytes: the weight's own size, bf16 activations)
and TFLOP/s (2 M N K). The summary gives, per projection, the smallest row count from which
W8A8 is at least as fast as weight-only at every larger count measured, and the sum over
the four projections. ``--sweep`` (both, or the paths named) also times candidate tiles
of the fp8 paths (the GEMV's
for rows up to MAX_ROWS, fp8_gemm's weight-only GEMM past them, and its W8A8 GEMM up to
``W8A8_GEMM_MAX_ROWS``) and prints the fastest beside the default; it writes the W8A8
GEMM's table (``configs/fp8_w8a8/<device>.json``, or ``--table``): for each bucket (16,
32, 64, 128 rows: the row counts above the last bucket up to this one), the tiles fastest
over every row count swept in it where they beat ``scaled_mm`` there, else null.
Writes every timing to ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if "--dry-run" in sys.argv and not torch.cuda.is_available():
    # Triton kernels on CPU tensors run through the interpreter, switched on before import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from atom_kernels_triton import fp8_gemm, tuning  # noqa: E402
from atom_kernels_triton.fp8_gemm import GemmConfig  # noqa: E402
from atom_kernels_triton.fp8_norm_quant import rms_norm_quant_fp8  # noqa: E402
from atom_kernels_triton.fp8_quant import quantize_rows  # noqa: E402
from atom_kernels_triton.gemv import linear, rms_norm_linear  # noqa: E402
from atom_kernels_triton.gemv_config import MAX_ROWS, GemvConfig, fp8_config  # noqa: E402
from atom_kernels_triton.norm import fused_add_rms_norm  # noqa: E402
from common import graph_us, load_config, rel_err, write_json  # noqa: E402

from atom_core.ops.native.linear import rms_norm_linear as native_rms_norm_linear  # noqa: E402
from atom_core.ops.native.norm import rms_norm_quant_fp8 as native_rms_norm_quant_fp8  # noqa: E402
from atom_core.quant.fp8 import Fp8Weight, fp8_linear, quantize_weight  # noqa: E402

ROWS = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096]
NEVER = 1 << 62  # a w8a8_min_rows no batch reaches
TOLERANCE = 1.6e-2  # bf16 output against the fp32 reference
PATHS = ("cublas", "bf16_op", "fp8_wonly", "fp8_w8a8", "scaled_mm", "scaled_exact")
NORM_FED = ("qkv_proj", "gate_up")
SWEEPS = ("wonly", "w8a8")  # their input is a pre-norm block's norm
EPS = 1e-6


def projections(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(name, N, K) of a dense decoder's four projections."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    qkv = (heads + 2 * cfg["num_key_value_heads"]) * head_dim
    inter = cfg["intermediate_size"]
    return [("qkv_proj", qkv, hidden), ("o_proj", hidden, heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def gemm_candidates(m: int) -> list[GemmConfig]:
    """The weight-only GEMM's sweep: one M tile up to 64 rows (either orientation), 64 and
    128-row tiles past that, on 4 or 8 warps."""
    if m <= 64:
        block_ms = [max(16, 1 << (m - 1).bit_length())]
        grid = itertools.product(block_ms, (64, 128), (128, 256), (1, 2, 4), (True, False), (4,),
                                 (4,))
    else:
        grid = itertools.product((64, 128), (128,), (64, 128), (1, 2), (True, False), (4, 8),
                                 (4,))
    return [GemmConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, SWAP=sw, num_warps=w,
                       num_stages=st) for bm, bn, bk, s, sw, w, st in grid]


def gemv_candidates(m: int, k: int) -> list[GemvConfig]:
    """The fp8 GEMV's sweep: the 1-row path's fp32 tile within 8192 values, BLOCK_K up to
    2048 (16 e4m3 values a 16-byte load); the tl.dot path's tiles."""
    if m == 1:
        grid = itertools.product((4, 8, 16), (512, 1024, 2048), (1, 2), (4,), (2,))
    else:
        grid = itertools.product((32, 64), (128, 256, 512), (1, 2), (4,), (4,))
    out = []
    for bn, bk, split, warps, stages in grid:
        if (m == 1 and bn * bk > 8192) or bk > k or math.ceil(k / bk) < 2 * split:
            continue
        out.append(GemvConfig(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                              num_stages=stages))
    return out


def with_min_rows(w: Fp8Weight, rows: int) -> Fp8Weight:
    return Fp8Weight(w.qweight, w.scale, rows)


def bench_projection(
    proj: str, n: int, k: int, rows: list[int], calls: int, sweep: list[str], l2_bytes: int,
) -> list[dict[str, Any]]:
    copies = max(1, min(calls, math.ceil(4 * l2_bytes / (n * k))))
    bf16 = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
            for _ in range(copies)]
    fp8 = [quantize_weight(w) for w in bf16]
    results = []

    def timed(fn: Callable[..., Any], x: torch.Tensor, weights: list[Any]) -> float:
        return graph_us([lambda w=weights[i % copies]: fn(x, w) for i in range(calls)])

    for m in rows:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        wonly = [with_min_rows(w, NEVER) for w in fp8]
        w8a8 = [with_min_rows(w, 1) for w in fp8]
        r: dict[str, Any] = {"proj": proj, "N": n, "K": k, "M": m,
                             "flop": 2 * m * n * k}
        r["cublas_us"] = timed(F.linear, x, bf16)
        r["bf16_op_us"] = timed(linear, x, bf16)
        r["fp8_wonly_us"] = timed(linear, x, wonly)
        r["fp8_w8a8_us"] = timed(linear, x, w8a8)
        r["scaled_mm_us"] = timed(scaled_mm, x, w8a8)
        r["scaled_exact_us"] = timed(functools.partial(scaled_mm, fast=False), x, w8a8)
        r["quant_us"] = graph_us([lambda x=x: quantize_rows(x)] * calls)
        for path, elem in (("cublas", 2), ("bf16_op", 2), ("fp8_wonly", 1), ("fp8_w8a8", 1),
                           ("scaled_mm", 1), ("scaled_exact", 1)):
            r[f"{path}_bytes"] = n * k * elem + 2 * m * (k + n)
        ref = fp8_linear(x, fp8[0], w8a8=False)
        r["fp8_wonly_err"] = rel_err(linear(x, wonly[0]), ref)
        r["fp8_w8a8_err"] = rel_err(linear(x, w8a8[0]), fp8_linear(x, fp8[0], w8a8=True))
        if "wonly" in sweep:
            r["sweep"] = sweep_point(x, wonly, ref, calls, copies)
        if "w8a8" in sweep and m <= fp8_gemm.W8A8_GEMM_MAX_ROWS:
            r["sweep_w8a8"] = sweep_w8a8(x, w8a8, calls, copies)
        print(row_line(r), flush=True)
        if proj in NORM_FED:
            r.update(bench_norm_fed(x, w8a8, calls, copies))
            print(norm_line(r), flush=True)
        results.append(r)
    bf16.clear()
    fp8.clear()
    torch.cuda.empty_cache()
    return results


def scaled_mm(x: torch.Tensor, w: Fp8Weight,
              fast: bool = fp8_gemm.SCALED_MM_FAST_ACCUM) -> torch.Tensor:
    """The W8A8 product through ``torch._scaled_mm`` at any row count; ``fast``: its fast
    accumulation."""
    xq, xs = quantize_rows(x)
    return torch._scaled_mm(xq, w.qweight.t(), scale_a=xs[:, None], scale_b=w.scale[None, :],
                            out_dtype=x.dtype, use_fast_accum=fast)


def w8a8_candidates(m: int) -> list[GemmConfig]:
    """The W8A8 GEMM's sweep: one M tile up to 64 rows (64-row tiles past it); W's tile on the
    tensor cores' M side (SWAP), 64 or 128 wide, BLOCK_K 128 or 256, up to 4 splits; and two
    x W^T tiles."""
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    swapped = [(bn, bk, s, True) for bn, bk, s in itertools.product((64, 128), (128, 256),
                                                                     (1, 2, 4))]
    plain = [(64, 256, s, False) for s in (2, 4)]
    return [GemmConfig(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, SWAP=sw,
                       num_warps=4, num_stages=4) for bn, bk, s, sw in swapped + plain]


def sweep_w8a8(x: torch.Tensor, weights: list[Fp8Weight], calls: int, copies: int
               ) -> dict[str, Any]:
    """The W8A8 GEMM's candidate tiles at x's rows (x quantized once, outside the timing):
    {"default", "best", "all"}."""
    m, k = x.shape
    n = weights[0].qweight.shape[0]
    xq, xs = quantize_rows(x)
    ref = fp8_linear(x, weights[0], w8a8=True)
    default = dict(fp8_gemm.w8a8_config(m, n, k, torch.cuda.get_device_properties(0)
                                        .multi_processor_count))
    rows = []
    for c in [default, *w8a8_candidates(m)]:
        def fn(w: Fp8Weight, c: dict[str, Any] = c) -> torch.Tensor:
            return fp8_gemm.w8a8_matmul(xq, xs, w, None, x.dtype, config=GemmConfig(**c))
        try:
            if rel_err(fn(weights[0]), ref) >= TOLERANCE:
                print(f"  W8A8 M={m} {c}: off the reference, skipped", flush=True)
                continue
            us = graph_us([lambda w=weights[i % copies]: fn(w) for i in range(calls)])
        except Exception as e:  # out of shared memory / registers at compile time
            print(f"  W8A8 M={m} {c}: {type(e).__name__}, skipped", flush=True)
            continue
        rows.append({**c, "us": us})
    best = min(rows, key=lambda r: r["us"])
    print(f"  sweep W8A8 M={m}: default {rows[0]['us']:.2f} us, best {best['us']:.2f} us "
          f"{best}", flush=True)
    return {"default": rows[0], "best": best, "all": rows}


def bench_norm_fed(x: torch.Tensor, weights: list[Fp8Weight], calls: int, copies: int
                   ) -> dict[str, Any]:
    """The residual add + RMSNorm before a W8A8 product: two ops against ``rms_norm_linear``
    (one norm-and-quantize kernel), with and without the product."""
    m, k = x.shape
    res = torch.randn_like(x)
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(x.dtype)

    def two_ops(w: Fp8Weight) -> torch.Tensor:
        return linear(fused_add_rms_norm(x, res, nw, EPS)[0], w)

    def fused(w: Fp8Weight) -> torch.Tensor:
        return rms_norm_linear(x, res, nw, EPS, w)[0]

    def timed(fn: Callable[[Fp8Weight], Any]) -> float:
        return graph_us([lambda w=weights[i % copies]: fn(w) for i in range(calls)])

    r: dict[str, Any] = {
        "norm_w8a8_us": timed(two_ops),
        "fused_norm_w8a8_us": timed(fused),
        "norm_quant_us": graph_us(
            [lambda: quantize_rows(fused_add_rms_norm(x, res, nw, EPS)[0])] * calls),
        "fused_norm_quant_us": graph_us([lambda: rms_norm_quant_fp8(x, res, nw, EPS)] * calls),
        # x and the residual read, the sum (bf16) and the e4m3 rows written
        "fused_norm_quant_bytes": 7 * m * k,
    }
    ref = native_rms_norm_linear(x, res, nw, EPS, weights[0])[0]
    r["fused_norm_w8a8_err"] = rel_err(fused(weights[0]), ref)
    return r


def norm_line(r: dict[str, Any]) -> str:
    tbs = r["fused_norm_quant_bytes"] / r["fused_norm_quant_us"] / 1e6
    return (f"  + add+norm: two ops {r['norm_w8a8_us']:.2f} us, fused "
            f"{r['fused_norm_w8a8_us']:.2f} us; before the GEMM: norm + quant "
            f"{r['norm_quant_us']:.2f} us, norm-quant {r['fused_norm_quant_us']:.2f} us "
            f"({tbs:.2f} TB/s); err {r['fused_norm_w8a8_err']:.1e}")


def sweep_point(x: torch.Tensor, weights: list[Fp8Weight], ref: torch.Tensor, calls: int,
                copies: int) -> dict[str, Any]:
    """The weight-only path's candidate tiles at x's rows: {"default", "best", "all"}."""
    m, k = x.shape
    n = weights[0].qweight.shape[0]
    if m <= MAX_ROWS:
        default: dict[str, Any] = dict(fp8_config(m, n, k))
        space = [default, *gemv_candidates(m, k)]

        def run(c: dict[str, Any]) -> Callable[[Fp8Weight], torch.Tensor]:
            return lambda w: linear(x, w, config=GemvConfig(**c))
    else:
        default = dict(fp8_gemm.default_config(m, n, k, torch.cuda.get_device_properties(0)
                                               .multi_processor_count))
        space = [default, *gemm_candidates(m)]

        def run(c: dict[str, Any]) -> Callable[[Fp8Weight], torch.Tensor]:
            return lambda w: fp8_gemm.weight_only_linear(x, w, config=GemmConfig(**c))
    rows = []
    for c in space:
        fn = run(c)
        try:
            if rel_err(fn(weights[0]), ref) >= TOLERANCE:
                print(f"  M={m} {c}: off the reference, skipped", flush=True)
                continue
            us = graph_us([lambda w=weights[i % copies], fn=fn: fn(w) for i in range(calls)])
        except Exception as e:  # out of shared memory / registers at compile time
            print(f"  M={m} {c}: {type(e).__name__}, skipped", flush=True)
            continue
        rows.append({**c, "us": us})
    best = min(rows, key=lambda r: r["us"])
    print(f"  sweep M={m}: default {rows[0]['us']:.2f} us, best {best['us']:.2f} us {best}",
          flush=True)
    return {"default": rows[0], "best": best, "all": rows}


HEADER = (f"{'proj':9} {'N':>6} {'K':>6} {'M':>5} | "
          + " | ".join(f"{p:>10} us  TB/s TF/s" for p in PATHS) + f" | {'quant us':>8}")


def row_line(r: dict[str, Any]) -> str:
    def cell(path: str) -> str:
        us = r[f"{path}_us"]
        return f"{us:13.2f} {r[f'{path}_bytes'] / us / 1e6:5.2f} {r['flop'] / us / 1e6:4.0f}"

    return (f"{r['proj']:9} {r['N']:6d} {r['K']:6d} {r['M']:5d} | "
            + " | ".join(cell(p) for p in PATHS) + f" | {r['quant_us']:8.2f}")


def crossover(results: list[dict[str, Any]]) -> int | None:
    """The smallest M from which W8A8 is at least as fast as weight-only at every larger M
    measured (None where weight-only wins at the largest)."""
    found = None
    for r in sorted(results, key=lambda r: -r["M"]):
        if r["fp8_w8a8_us"] > r["fp8_wonly_us"]:
            break
        found = r["M"]
    return found


def summary(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for proj in dict.fromkeys(r["proj"] for r in results):
        rs = [r for r in results if r["proj"] == proj]
        lines.append(f"{proj:9} W8A8 >= weight-only from M = {crossover(rs)}")
    for m in sorted({r["M"] for r in results}):
        rs = [r for r in results if r["M"] == m]
        tot = {p: sum(r[f"{p}_us"] for r in rs) for p in PATHS}
        lines.append(f"M={m:5d}: four projections " + "  ".join(
            f"{p} {tot[p]:8.1f} us" for p in PATHS))
    lines.append(f"all four: W8A8 >= weight-only from M = {crossover_total(results)}")
    for m in sorted({r["M"] for r in results}):
        rs = [r for r in results if r["M"] == m and "fused_norm_w8a8_us" in r]
        if rs:
            two = sum(r["norm_w8a8_us"] for r in rs)
            one = sum(r["fused_norm_w8a8_us"] for r in rs)
            lines.append(f"M={m:5d}: add+norm+W8A8 ({', '.join(r['proj'] for r in rs)}): "
                         f"two ops {two:8.1f} us, fused {one:8.1f} us")
    return lines


def w8a8_entries(results: list[dict[str, Any]]) -> tuning.Table:
    """The W8A8 GEMM's table from a sweep: (N, K) -> bucket -> the tiles with the least time
    summed over every swept row count in the bucket, where that sum beats ``scaled_mm``'s,
    else None. A bucket's tiles serve every row count in it (40 rows take the 64-row
    bucket's), so they are chosen over the rows the bucket serves, not only at its top
    one: sweep them (``--rows 17 24 32 40 48 56 64``)."""
    groups: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for r in results:
        if r.get("sweep_w8a8") is not None:
            groups.setdefault((r["N"], r["K"], fp8_gemm.m_bucket(r["M"])), []).append(r)
    table: tuning.Table = {}
    for (n, k, bucket), rows in sorted(groups.items()):
        timings = [_sweep_timings(r) for r in rows]
        # Only tiles timed at every row count of the bucket (a compile can fail at one).
        common = set.intersection(*(set(t) for t in timings))
        best = min(common, key=lambda key: sum(t[key] for t in timings), default=None)
        wins = best is not None and (sum(t[best] for t in timings)
                                     < sum(r["scaled_mm_us"] for r in rows))
        table.setdefault((n, k), {})[bucket] = dict(best) if wins else None
    return table


def _sweep_timings(r: dict[str, Any]) -> dict[tuple, float]:
    """One row count's W8A8 sweep as tiles -> us (the default may repeat a candidate)."""
    out: dict[tuple, float] = {}
    for c in r["sweep_w8a8"]["all"]:
        key = tuple(sorted((name, v) for name, v in c.items() if name != "us"))
        out[key] = min(c["us"], out.get(key, math.inf))
    return out


def write_w8a8_table(results: list[dict[str, Any]], path: Path | None,
                     argv: list[str] | None) -> None:
    device = torch.cuda.get_device_name()
    table = {shape: dict(b) for shape, b in tuning.load(fp8_gemm.W8A8_OP, device).configs.items()}
    for shape, buckets in w8a8_entries(results).items():
        table.setdefault(shape, {}).update(buckets)
    path = path or tuning.table_path(fp8_gemm.W8A8_OP, device)
    producer = " ".join(["python bench/fp8_linear.py", *(sys.argv[1:] if argv is None else argv)])
    tuning.dump(path, device, table, producer)
    print(f"wrote {path}")


def crossover_total(results: list[dict[str, Any]]) -> int | None:
    totals = [{"M": m, **{f"{p}_us": sum(r[f"{p}_us"] for r in results if r["M"] == m)
                          for p in ("fp8_wonly", "fp8_w8a8")}}
              for m in sorted({r["M"] for r in results})]
    return crossover(totals)


def dry_run(model: str, rows: list[int]) -> None:
    """On CPU: the plan, and each fp8 path once on the projections scaled down 64 times
    (the Triton kernels through the interpreter), against the reference."""
    print(f"{model}: {len(projections(load_config(model)))} projections x {len(rows)} row "
          f"counts {rows}; paths {', '.join(PATHS)} (CUDA only: the timings)")
    for proj, n, k in projections(load_config(model)):
        n, k = n // 64, k // 64
        w = quantize_weight(torch.randn(n, k) / k**0.5)
        for m in (1, MAX_ROWS + 1):
            x = torch.randn(m, k).to(torch.float16)
            err = rel_err(linear(x, with_min_rows(w, NEVER)), fp8_linear(x, w, w8a8=False))
            print(f"  {proj} [{n} x {k}] M={m}: weight-only rel err {err:.2e}")
        q, s = quantize_rows(x)
        print(f"  {proj}: quantize_rows {tuple(q.shape)}, scales {tuple(s.shape)}")
        err = rel_err(fp8_gemm.w8a8_matmul(q, s, w, None, x.dtype), fp8_linear(x, w, w8a8=True))
        print(f"  {proj} M={MAX_ROWS + 1}: W8A8 GEMM rel err {err:.2e}")
        if proj in NORM_FED:
            res, nw = torch.randn_like(x), torch.ones(k, dtype=x.dtype)
            q, s, _ = rms_norm_quant_fp8(x, res, nw, EPS)
            ref_q, ref_s, _ = native_rms_norm_quant_fp8(x, res, nw, EPS)
            same = (q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
            print(f"  {proj}: rms_norm_quant_fp8 scales rel err {rel_err(s, ref_s):.1e}, "
                  f"{same:.1%} of e4m3 values equal to the reference's")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per CUDA graph")
    ap.add_argument("--sweep", nargs="*", choices=SWEEPS, default=None,
                    help="also time candidate tiles of these fp8 paths (none named: both)")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: print the plan and run each fp8 path once, small")
    ap.add_argument("--table", type=Path,
                    help="the W8A8 table --sweep writes (default: the package's for this GPU)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "fp8_linear.json")
    args = ap.parse_args(argv)
    # --sweep alone: both paths; not given: none.
    args.sweep = [] if args.sweep is None else (args.sweep or list(SWEEPS))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args.model, args.rows)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_linear.py needs a CUDA GPU (--dry-run runs on CPU)")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 << 20
    print(f"{props.name}: L2 {l2_bytes >> 20} MiB, {args.calls} calls per graph")
    print(HEADER, flush=True)
    results = []
    for proj, n, k in projections(load_config(args.model)):
        results += bench_projection(proj, n, k, args.rows, args.calls, args.sweep, l2_bytes)
    print("\n".join(summary(results)))
    if "w8a8" in args.sweep:
        write_w8a8_table(results, args.table, argv)
    path = write_json(args.json, {"model": args.model, "calls_per_graph": args.calls,
                                  "crossover_all": crossover_total(results),
                                  "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
