"""Decode-sized linear layers: F.linear (cuBLAS) vs the Triton skinny GEMM (``linear`` op).

    python bench/gemv.py [--models qwen3-0.6b qwen3-8b qwen3-30b-a3b deepseek-v2-lite]
        [--rows 1 2 4 8 16 32] [--dtype bf16] [--calls 20] [--no-sweep]
        [--json bench/results/gemv.json]
    python bench/gemv.py --table-from bench/results/gemv.json [more.json ...] [--table PATH]

Shapes are every projection that goes through the ``linear`` op (attention, dense MLPs,
shared experts, the LM head; not the routed experts, which are ``fused_moe``), from
``bench/configs/<model>/config.json``. Each op is timed as a CUDA graph of ``--calls``
back-to-back calls (no launch gaps), replayed; the calls cycle through enough copies of
the weight to overflow L2, as a decode step's layers each read their own weight. For each
shape and M: cuBLAS, the Triton default heuristic, and the best of a small config sweep
(its three leaders timed again, and cuBLAS again beside them, before the table compares),
in microseconds and TB/s (weight + x + out bytes / time; "triton" is what the op runs
today: the device's table if it has the shape, else the default heuristic), beside the copy
bandwidth (read + write) measured in the same run. Projections the model runs as a fused op
(the pre-norm's ``rms_norm_linear``, the gated MLP's ``silu_and_mul_linear``) also time that
op against its two ops ("fused us", "2 ops us"), as the model calls them. Writes the points
it measured into the device's table (``atom_kernels_triton/configs/gemv/<device>.json``, or
``--table``; the entries the file lists in ``in_model`` are kept) and every timing to
``--json``; ``--table-from`` writes the table from stored runs merged (later files win), no
GPU needed. ``--rows 32`` sweeps the 32-row tile (``gemv_config.WIDE_ROWS``) on every
projection, each candidate put in the table while it is timed (the op serves 32 rows only
where the table has an entry); its picks are printed, to be checked in the model
(``decode_latency.py --gemv-config``) and added to the table and its ``in_model`` by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from atom_kernels_triton import tuning  # noqa: E402
from atom_kernels_triton.activation import silu_and_mul  # noqa: E402
from atom_kernels_triton.gemv import linear, rms_norm_linear, silu_and_mul_linear  # noqa: E402
from atom_kernels_triton.gemv_config import (  # noqa: E402
    MAX_ROWS,
    OP,
    WIDE_ROWS,
    GemvConfig,
    GemvTable,
    get_config,
    tuned,
)
from atom_kernels_triton.norm import fused_add_rms_norm  # noqa: E402
from common import MODELS, graph_us, load_config, rel_err  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB per block; keep a little slack
# Projections a decoder layer runs through a fused op: "norm" (``rms_norm_linear``: the
# pre-norm's residual add + RMSNorm, then this projection), "gated" (``silu_and_mul_linear``:
# x is gate | up, twice K wide). DeepSeek's shared experts sit in a MoE block, which keeps
# its norm apart (the router reads the normed input too), but their down is gated.
FUSED = {"qkv_proj": "norm", "gate_up": "norm", "mlp.gate_up": "norm",
         "down": "gated", "mlp.down": "gated", "shared.down": "gated"}


def projections(cfg: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """(name, N, K, calls per decode step) of each ``linear``-op projection of a config."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    out: list[tuple[str, int, int, int]] = []
    if cfg["model_type"].startswith("deepseek"):
        qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        if cfg.get("q_lora_rank"):
            out += [("q_a_proj", cfg["q_lora_rank"], hidden, layers),
                    ("q_b_proj", heads * qk_head, cfg["q_lora_rank"], layers)]
        else:
            out.append(("q_proj", heads * qk_head, hidden, layers))
        # kv_b_proj's weight goes to the MLA kernels, not through the op.
        out += [("kv_a_proj", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], hidden, layers),
                ("o_proj", hidden, heads * cfg["v_head_dim"], layers)]
        dense = cfg.get("first_k_dense_replace", 0)
        if dense:
            out += [("mlp.gate_up", 2 * cfg["intermediate_size"], hidden, dense),
                    ("mlp.down", hidden, cfg["intermediate_size"], dense)]
        shared = cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0)
        if shared and layers > dense:
            out += [("shared.gate_up", 2 * shared, hidden, layers - dense),
                    ("shared.down", hidden, shared, layers - dense)]
    else:
        head_dim = cfg.get("head_dim") or hidden // heads
        qkv = (heads + 2 * cfg["num_key_value_heads"]) * head_dim
        out += [("qkv_proj", qkv, hidden, layers), ("o_proj", hidden, heads * head_dim, layers)]
        if "num_experts" not in cfg:  # a dense model's MLP (Qwen3-MoE's are all fused_moe)
            out += [("gate_up", 2 * cfg["intermediate_size"], hidden, layers),
                    ("down", hidden, cfg["intermediate_size"], layers)]
    out.append(("lm_head", cfg["vocab_size"], hidden, 1))
    return out


def candidates(m: int, n: int, k: int, elem_size: int) -> list[GemvConfig]:
    """The sweep: small, so that compiling it all fits the run in minutes."""
    if m == 1:
        grid = itertools.product((4, 8, 16, 32), (256, 512, 1024), (1, 2, 4), (4, 8), (2,))
    elif m <= MAX_ROWS:
        grid = itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8), (4,), (3, 4))
    else:  # the 32-row tile (W x^T), where BLOCK_N 64 and 5 stages won on the H200
        grid = itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), (4,), (3, 4, 5))
    out = []
    for bn, bk, split, warps, stages in grid:
        if bk > max(128, 1 << math.ceil(math.log2(k))):
            continue  # a tile wider than K
        if split > 1 and math.ceil(k / bk) < 2 * split:
            continue  # splits of under two chunks: not worth the reduce kernel
        tile_rows = MAX_ROWS if m <= MAX_ROWS else WIDE_ROWS
        if m > 1 and stages * (bn + tile_rows) * bk * elem_size > SMEM_BYTES:
            continue
        # The 1-row path keeps an fp32 [BLOCK_N, BLOCK_K] tile in registers: 8192 is 64 per
        # thread at 4 warps; 8 warps only pays for the largest tiles.
        if m == 1 and (bn * bk > 8192 or (warps == 8 and bn * bk < 8192)):
            continue
        out.append(GemvConfig(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                              num_stages=stages))
    return out


def bytes_moved(m: int, n: int, k: int, elem_size: int) -> int:
    return (n * k + m * k + m * n) * elem_size


def tbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e6


def config_str(c: GemvConfig) -> str:
    return f"{c['BLOCK_N']}x{c['BLOCK_K']} s{c['SPLIT_K']} w{c['num_warps']} st{c['num_stages']}"


HEADER = (
    f"{'model':16} {'proj':14} {'N':>6} {'K':>6} {'M':>3} | {'cuBLAS us':>9} {'TB/s':>5} | "
    f"{'triton us':>9} {'TB/s':>5} | {'best us':>8} {'TB/s':>5} {'best config':>22} | "
    f"{'fused us':>8} {'2 ops us':>8}"
)


def table_row(r: dict[str, Any]) -> str:
    def cell(us: float | None, width: int) -> str:
        if us is None:
            return f"{'-':>{width}} {'-':>5}"
        return f"{us:{width}.2f} {tbps(r['bytes'], us):5.2f}"

    best = config_str(r["best_config"]) if r.get("best_config") else "-"
    fused = "" if r.get("fused_us") is None else f" | {r['fused_us']:8.2f} {r['two_ops_us']:8.2f}"
    return (
        f"{r['model']:16} {r['proj']:14} {r['N']:6d} {r['K']:6d} {r['M']:3d} | "
        f"{cell(r['cublas_us'], 9)} | "
        f"{cell(r['triton_us'], 9)} | {cell(r.get('best_us'), 8)} {best:>22}{fused}"
    )


def step_summary(results: list[dict[str, Any]]) -> list[str]:
    """Per model and M: the decode step's linear time (each projection x its calls)."""
    lines = []
    keys = sorted({(r["model"], r["M"]) for r in results}, key=lambda t: (MODELS.index(t[0])
                  if t[0] in MODELS else len(MODELS), t[0], t[1]))
    for model, m in keys:
        rows = [r for r in results if r["model"] == model and r["M"] == m]
        total = {
            col: sum(r[col] * r["calls_per_step"] for r in rows if r.get(col) is not None)
            for col in ("cublas_us", "triton_us", "best_us")
        }
        lines.append(
            f"{model:16} M={m:2d}: linears per step  cuBLAS {total['cublas_us']:8.1f} us  "
            f"triton {total['triton_us']:8.1f} us  best {total['best_us']:8.1f} us"
        )
    return lines


def new_table(
    results: list[dict[str, Any]], table: GemvTable, in_model: frozenset[tuple[int, int, int]],
    margin: float = 0.03,
) -> tuple[GemvTable, list[str]]:
    """``table`` with every point measured put in: the best swept config where it beat
    cuBLAS by > margin, else None (the op then calls cuBLAS). Entries chosen in the model
    (``in_model``) stay as they are: back-to-back calls of one projection cannot see what
    decided them. A 32-row point is only a candidate (second value, one line each): the
    tile ran faster alone on projections where it slowed the model, so an entry goes in
    after a check there (``decode_latency.py --gemv-config N,K,32=...``)."""
    out = {shape: dict(per_m) for shape, per_m in table.items()}
    candidates = []
    for r in sorted(results, key=lambda r: (r["N"], r["K"], r["M"])):
        n, k, m = r["N"], r["K"], r["M"]
        if r.get("best_us") is None or (n, k, m) in in_model:
            continue
        wins = r["best_us"] < r["cublas_us"] * (1 - margin)
        config = GemvConfig(**r["best_config"]) if wins else None
        if m == WIDE_ROWS:
            if config is not None:
                args = ",".join(str(v) for v in config.values())
                candidates.append(f"{n},{k},{m}={args}  # swept alone: check in the model first")
            continue
        out.setdefault((n, k), {})[m] = config
    return out, candidates


def write_table(
    results: list[dict[str, Any]], device: str, path: Path | None, argv: list[str]
) -> None:
    table, candidates = new_table(results, tuned(device), tuning.in_model(OP, device))
    path = path or tuning.table_path(OP, device)
    in_model = sorted(list(e) for e in tuning.in_model(OP, device))
    producer = " ".join(["python bench/gemv.py", *argv])
    tuning.dump(path, device, table, producer, in_model=in_model)
    print(f"wrote {path}")
    if candidates:
        print("32-row candidates (decode_latency.py --gemv-config):\n" + "\n".join(candidates))


# --- the GPU side ---------------------------------------------------------------------------


@contextlib.contextmanager
def table_entry(table: GemvTable, n: int, k: int, m: int, config: GemvConfig) -> Iterator[None]:
    """``config`` in ``table`` for the 32-row bucket while the block runs: the op serves 17-32
    rows only for shapes whose table has that entry, so a candidate is timed as the model
    would run it. Other buckets take the config directly and need nothing."""
    if m <= MAX_ROWS:
        yield
        return
    per_m = table.setdefault((n, k), {})
    had, old = WIDE_ROWS in per_m, per_m.get(WIDE_ROWS)
    per_m[WIDE_ROWS] = config
    try:
        yield
    finally:
        if had:
            per_m[WIDE_ROWS] = old
        else:
            del per_m[WIDE_ROWS]
            if not per_m:
                del table[(n, k)]


def bench_shape(
    model: str, proj: str, n: int, k: int, per_step: int, rows: list[int], dtype: torch.dtype,
    calls: int, sweep: bool, l2_bytes: int, num_sms: int,
) -> list[dict[str, Any]]:
    elem = torch.tensor([], dtype=dtype).element_size()
    table = tuned(tuning.device_name())
    # Enough weight copies that a graph's calls never find their weight in L2.
    copies = max(1, min(calls, math.ceil(4 * l2_bytes / (n * k * elem))))
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]
    results = []

    def calls_of(fn: Callable[..., Any], x: torch.Tensor, **kw: Any) -> list[Callable[[], Any]]:
        return [lambda w=weights[i % copies]: fn(x, w, **kw) for i in range(calls)]

    for m in rows:
        x = torch.randn(m, k, device="cuda").to(dtype)
        ref = F.linear(x.float(), weights[0].float())
        r: dict[str, Any] = {
            "model": model, "proj": proj, "N": n, "K": k, "M": m, "calls_per_step": per_step,
            "bytes": bytes_moved(m, n, k, elem),
            "triton_config": get_config(m, n, k, elem, num_sms, table),
            "cublas_us": graph_us(calls_of(F.linear, x)),
            "triton_us": graph_us(calls_of(linear, x)),
        }
        r["triton_err"] = rel_err(linear(x, weights[0]), ref)
        if proj in FUSED:
            r["fused_us"], r["two_ops_us"] = time_fused(FUSED[proj], x, calls_of)
        if sweep:
            swept = []
            def timed(c: GemvConfig, x: torch.Tensor = x, m: int = m) -> float:
                with table_entry(table, n, k, m, c):
                    return graph_us(calls_of(linear, x, config=c))

            for c in candidates(m, n, k, elem):
                try:
                    with table_entry(table, n, k, m, c):
                        if rel_err(linear(x, weights[0], config=c), ref) >= TOLERANCE[dtype]:
                            print(f"  {proj} M={m} {config_str(c)}: off the reference, skipped",
                                  flush=True)
                            continue
                    swept.append((timed(c), c))
                except Exception as e:  # out of shared memory / registers at compile time
                    print(f"  {proj} M={m} {config_str(c)}: {type(e).__name__}, skipped",
                          flush=True)
            swept.sort(key=lambda t: t[0])
            if swept:
                r["best_us"], r["best_config"] = retime_leaders(swept, timed)
                # cuBLAS timed again beside the leaders: the table compares the two.
                r["cublas_first_us"] = r["cublas_us"]
                r["cublas_us"] = graph_us(calls_of(F.linear, x))
            r["swept"] = [{"us": us, **c} for us, c in swept]
        print(table_row(r), flush=True)
        results.append(r)
    weights.clear()  # free them before the next shape's
    torch.cuda.empty_cache()
    return results


def retime_leaders(
    swept: list[tuple[float, GemvConfig]], time_config: Callable[[GemvConfig], float],
    leaders: int = 3,
) -> tuple[float, GemvConfig]:
    """The fastest of the ``leaders`` best swept configs, each timed once more.

    The minimum of a sweep's ~40 noisy timings is biased low (the winner's curse): fresh
    timings of the leaders decide instead."""
    again = [(time_config(c), c) for _, c in swept[:leaders]]
    return min(again, key=lambda t: t[0])


def time_fused(
    kind: str, x: torch.Tensor, calls_of: Callable[..., list[Callable[[], Any]]]
) -> tuple[float, float]:
    """(the fused op, its two ops) in us per call, on inputs shaped like x's rows."""
    g = torch.Generator(device="cuda").manual_seed(1)
    if kind == "gated":
        xg = torch.randn(x.shape[0], 2 * x.shape[1], device="cuda", generator=g).to(x.dtype)
        return (graph_us(calls_of(silu_and_mul_linear, xg)),
                graph_us(calls_of(lambda a, w: linear(silu_and_mul(a), w), xg)))
    res = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    nw = (1 + 0.1 * torch.randn(x.shape[1], device="cuda", generator=g)).to(x.dtype)
    return (graph_us(calls_of(lambda a, w: rms_norm_linear(a, res, nw, 1e-6, w), x)),
            graph_us(calls_of(lambda a, w: linear(fused_add_rms_norm(a, res, nw, 1e-6)[0], w), x)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                    help=f"M values (<= {MAX_ROWS}, or {WIDE_ROWS}: the 32-row tile)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per CUDA graph")
    ap.add_argument("--no-sweep", action="store_true", help="time only cuBLAS and the default")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gemv.json")
    ap.add_argument("--table", type=Path,
                    help="the table file to write (default: the package's for this device)")
    ap.add_argument("--table-from", type=Path, nargs="+", metavar="JSON",
                    help="write the table from stored runs (later files win per point) and exit")
    args = ap.parse_args(argv)
    if any(not (1 <= m <= MAX_ROWS or m == WIDE_ROWS) for m in args.rows):
        ap.error(f"--rows must be within 1..{MAX_ROWS}, or {WIDE_ROWS} "
                 "(other M fall back to F.linear)")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.table_from:
        merged: dict[tuple[int, int, int], dict[str, Any]] = {}
        devices = set()
        for path in args.table_from:
            run = json.loads(path.read_text())
            devices.add(run["machine"]["gpu"])
            for r in run["results"]:
                merged[(r["N"], r["K"], r["M"])] = r
        if len(devices) != 1:
            sys.exit(f"--table-from: runs of one device only, got {sorted(devices)}")
        write_table(list(merged.values()), devices.pop(), args.table, argv)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/gemv.py needs a CUDA GPU")
    from common import copy_bandwidth, machine

    dtype = DTYPES[args.dtype]
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 << 20
    copy_bw = copy_bandwidth()
    print(f"{props.name}: copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write), "
          f"L2 {l2_bytes >> 20} MiB")
    print(HEADER, flush=True)
    start, results = time.time(), []
    for model in args.models:
        for proj, n, k, per_step in projections(load_config(model)):
            results += bench_shape(
                model, proj, n, k, per_step, args.rows, dtype, args.calls, not args.no_sweep,
                l2_bytes, props.multi_processor_count,
            )
    print(f"\n{len(results)} points in {time.time() - start:.0f} s")
    print("\n".join(step_summary(results)))
    write_table(results, props.name, args.table, argv)
    report = {
        "machine": machine(), "dtype": args.dtype, "calls_per_graph": args.calls,
        "copy_bandwidth_tbs": copy_bw / 1e12, "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
