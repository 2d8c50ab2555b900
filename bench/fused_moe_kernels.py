"""The fused-MoE GEMM kernels one at a time, at a decode batch, over block configs.

    python bench/fused_moe_kernels.py [--models qwen3-30b-a3b deepseek-v2-lite] [--tokens 32]
        [--block-n 16 32 64 128] [--block-k 128 256 512] [--warps 2 4 8] [--stages 2 3 4]
        [--json bench/results/fused_moe_kernels.json]

``tune_fused_moe.py`` times the whole op (alignment, both GEMMs, the k-sum) per config;
here each GEMM kernel (``_gate_up_kernel``, ``_down_kernel``) is timed alone (CUDA-graph
replay, ``triton.testing.do_bench_cudagraph``) over one routing of random logits, and
reported as bytes of the experts that routing touched per second: the table's config first,
then the fastest of the grid. The two kernels share one config in the table
(``fused_moe_config``), so a pick must suit both; choose it in the model
(``decode_latency.py``), where the kernels before and after change what is exposed.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_models import machine  # noqa: E402
from tune_fused_moe import model_shape  # noqa: E402

from atom_core.ops.triton import fused_moe as fm  # noqa: E402
from atom_core.ops.triton.fused_moe_config import get_config  # noqa: E402
from atom_core.ops.triton.moe_align import align_by_expert  # noqa: E402

SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB per block; keep a little slack


def kernels(shape: tuple[int, int, int, int], tokens: int, block_m: int) -> tuple[dict, int]:
    """name -> (launch(BLOCK_N, BLOCK_K, warps, stages), bytes of the touched experts,
    weight tiles per stage); and the number of experts touched."""
    experts, top_k, hidden, inter = shape[:4]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter**0.5).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=g), dim=-1).topk(top_k, dim=-1)
    touched = ids.unique().numel()
    pairs, block_expert = align_by_expert(ids, experts, block_m)
    blocks, num_pairs = pairs.numel() // block_m, tokens * top_k
    act = torch.empty((pairs.numel(), inter), dtype=x.dtype, device="cuda")
    per_pair = torch.empty((num_pairs, hidden), dtype=torch.float32, device="cuda")
    flat_weights = weights.reshape(-1).contiguous()

    def gate_up(bn: int, bk: int, warps: int, stages: int) -> None:
        fm._gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
            x, x.stride(0), w13, w13.stride(0), w13.stride(1), w13.stride(2), act, pairs, block_expert,
            num_pairs, top_k, hidden, inter, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32",
            PDL=False, num_warps=warps, num_stages=stages)

    def down(bn: int, bk: int, warps: int, stages: int) -> None:
        fm._down_kernel[(blocks, triton.cdiv(hidden, bn))](
            act, w2, w2.stride(0), w2.stride(1), w2.stride(2), flat_weights, per_pair, pairs, block_expert,
            num_pairs, top_k, top_k, hidden, inter, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32",
            PDL=False, num_warps=warps, num_stages=stages)

    return {"gate_up": (gate_up, touched * 2 * inter * hidden * 2, 2),
            "down": (down, touched * hidden * inter * 2, 1)}, touched


def time_us(launch, config: tuple[int, int, int, int]) -> float:
    run = functools.partial(launch, *config)
    run()  # compile outside the graph
    return triton.testing.do_bench_cudagraph(run, rep=10) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v2-lite"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "fused_moe_kernels.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fused_moe_kernels.py needs a CUDA GPU")
    report: dict = {"machine": machine(), "tokens": args.tokens, "models": {}}
    for name in args.models:
        shape = model_shape(name, 1)
        experts, top_k, hidden, inter = shape[:4]
        table = get_config(args.tokens, top_k, experts, hidden, inter)
        launches, touched = kernels(shape, args.tokens, table["BLOCK_M"])
        print(f"== {name}: E {experts} k {top_k} H {hidden} I {inter}, T {args.tokens}, {touched} experts "
              f"touched; table {table}", flush=True)
        report["models"][name] = {"experts_touched": touched, "table": table}
        for kname, (launch, nbytes, w_tiles) in launches.items():
            current = (table["BLOCK_N"], table["BLOCK_K"], table["num_warps"], table["num_stages"])
            rows = []
            for bn, bk, warps, stages in itertools.product(args.block_n, args.block_k, args.warps, args.stages):
                if stages * (table["BLOCK_M"] * bk + w_tiles * bk * bn) * 2 > SMEM_BYTES:
                    continue
                try:
                    rows.append((time_us(launch, (bn, bk, warps, stages)), (bn, bk, warps, stages)))
                except Exception as exc:  # out of shared memory or registers at compile time
                    print(f"   {kname} {(bn, bk, warps, stages)}: {type(exc).__name__}, skipped", flush=True)
            rows.sort()
            table_us = time_us(launch, current)
            print(f"-- {kname}: table {table_us:.1f} us ({nbytes / table_us / 1e6:.3f} TB/s)", flush=True)
            for us, (bn, bk, warps, stages) in rows[:5]:
                print(f"   BLOCK_N {bn:3d} BLOCK_K {bk:3d} warps {warps} stages {stages}: {us:7.1f} us "
                      f"({nbytes / us / 1e6:.3f} TB/s)", flush=True)
            report["models"][name][kname] = {"bytes": nbytes, "table_us": table_us,
                                             "configs": [{"us": us, "config": c} for us, c in rows]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
