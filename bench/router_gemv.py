"""The MoE router's fp32 GEMV at decode batch sizes: the ``linear`` op against cuBLAS's path.

    python bench/router_gemv.py [--models qwen3-30b-a3b deepseek-v2-lite]
        [--rows 1 8 16 32 64 128 256 512] [--calls 20] [--sweep]
        [--json bench/results/router_gemv.json]

The router keeps its gate weight in fp32 and takes the model-dtype hidden states
(``atom_core.layers.moe.TopKRouter``). cuBLAS's path is the native op: x cast to fp32, then
an SGEMM. The Triton op promotes x as it loads it; past 16 rows it takes the rows in blocks
of 16, each block reading the (small) weight again from L2. Each variant is timed as a
CUDA graph of ``--calls`` back-to-back calls, each with its own weight and input, as a
decode step's layers have; "limit" is the weight's bytes over the copy bandwidth measured
in the same run. Also times the op with a forced single split (``SPLIT_K=1``: no reduce
kernel) beside the default config, which may split K; ``--sweep`` times a grid of block
sizes and prints the fastest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_models import copy_bandwidth, load_config, machine  # noqa: E402
from gpu_timing import graph_us  # noqa: E402

from atom_core.ops.native.linear import linear as native_linear  # noqa: E402
from atom_core.ops.triton.gemv import linear, supported  # noqa: E402
from atom_core.ops.triton.gemv_config import MAX_ROWS, GemvConfig, get_config  # noqa: E402

MODELS = ("qwen3-30b-a3b", "deepseek-v2-lite")


def router_shape(model: str) -> tuple[int, int]:
    cfg = load_config(model)
    experts = cfg.get("num_experts") or cfg["n_routed_experts"]
    return experts, cfg["hidden_size"]


def sweep_configs(m: int) -> list[GemvConfig]:
    rows = min(MAX_ROWS, 1 << (m - 1).bit_length())
    grid = itertools.product((4, 8), (64, 128, 256), (1, 2, 4, 8), (4,))
    return [GemvConfig(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=w, num_stages=2)
            for bn, bk, s, w in grid if rows * bn * bk <= 4096 * w]  # <= 128 fp32 values a thread


def bench(model: str, rows: list[int], calls: int, copy_bw: float, sweep: bool) -> list[dict]:
    n, k = router_shape(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", generator=g) / k**0.5 for _ in range(calls)]
    out = []
    for m in rows:
        xs = [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(calls)]
        pairs = list(zip(xs, weights))
        ref = native_linear(xs[0], weights[0])
        base = get_config(min(m, MAX_ROWS), n, k, 4)
        variants = {"cublas": lambda x, w: native_linear(x, w)}
        if supported(xs[0], weights[0], None):
            variants["triton"] = lambda x, w: linear(x, w)
            if base is not None and base["SPLIT_K"] > 1:
                one = {**base, "SPLIT_K": 1}
                variants["triton_split1"] = lambda x, w, c=one: linear(x, w, config=c)
        r = {"model": model, "N": n, "K": k, "M": m, "config": base,
             "limit_us": n * k * 4 / copy_bw * 1e6}
        for name, fn in variants.items():
            err = (fn(xs[0], weights[0]) - ref).abs().max().item() / ref.abs().max().item()
            if err > 1e-5:
                raise SystemExit(f"{model} M={m} {name}: relative error {err:.2e} against the native op")
            r[f"{name}_us"] = graph_us([lambda x=x, w=w, fn=fn: fn(x, w) for x, w in pairs])
        if sweep and m > 1 and "triton" in variants:
            timed = sorted(
                ((graph_us([lambda x=x, w=w, c=c: linear(x, w, config=c) for x, w in pairs]), c)
                 for c in sweep_configs(m)),
                key=lambda t: t[0])
            r["sweep"] = [{"us": us, **c} for us, c in timed]
            r["best_us"], r["best_config"] = timed[0]
            variants["best"] = None
        cells = "  ".join(f"{name} {r[f'{name}_us']:7.2f}" for name in variants)
        if "best_config" in r:
            cells += f"  (best: {r['best_config']})"
        print(f"{model:18} {n:4d} x {k:5d}  M={m:4d}  {cells}  limit {r['limit_us']:.2f} us", flush=True)
        out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time a grid of block sizes past one row")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "router_gemv.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/router_gemv.py needs a CUDA GPU")
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; microseconds per call")
    results = [r for model in args.models for r in bench(model, args.rows, args.calls, copy_bw, args.sweep)]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine(), "copy_bandwidth_tbs": copy_bw / 1e12,
                                     "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
