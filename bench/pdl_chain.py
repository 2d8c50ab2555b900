"""Programmatic dependent launch on a chain of decode GEMVs (GPU, sm_90+).

Qwen3-0.6B's four projections per layer (qkv, o, gate_up, down), 28 layers, batch 1, each
GEMV reading the previous one's output, captured in one CUDA graph; per chain: cuBLAS,
a Triton GEMV launched normally, with PDL waiting first, and with PDL loading its whole
weight slice before waiting (what ops/triton/pdl.py's rule allows: weights are not written
during a step). Beside them the roofline: the chain's weight bytes over 4.27 TB/s.

    python bench/pdl_chain.py [--json bench/results/session3/pdl_chain.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).parent))
from gpu_timing import graph_us  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # (N, K) per layer
LAYERS = 28
COPY_BW = 4.27e12


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    if MODE == 2:  # weights first, then wait for the previous kernel
        kp = tl.arange(0, KP)
        w = tl.load(w_rows + kp[None, :], mask=kp[None, :] < K, other=0.0)
        gdc_launch_dependents()
        gdc_wait()
        a = tl.load(x_ptr + kp, mask=kp < K, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    else:
        if MODE == 1:  # wait first
            gdc_launch_dependents()
            gdc_wait()
        ks = tl.arange(0, BLOCK_K)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(x_ptr + k0 + ks).to(tl.float32)
            acc2 += tl.load(w_rows + k0 + ks[None, :]).to(tl.float32) * a[None, :]
        acc = tl.sum(acc2, axis=1)
    tl.store(y_ptr + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < N)


def chain(ws, ys, x, mode: int, pdl: bool) -> None:
    for layer in ws:
        for (n, k), w, y in zip(SHAPES, layer, ys):
            if mode < 0:
                torch.mm(w, x[:k, None], out=y[:, None])
            else:
                extra = {"launch_pdl": True} if pdl else {}
                _gemv[(n // 4,)](x, w, y, n, K=k, KP=triton.next_power_of_2(k), BLOCK_N=4,
                                 BLOCK_K=min(512, k), MODE=mode, num_warps=4, num_stages=2, **extra)
            x = y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="bench/results/session3/pdl_chain.json")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    ws = [[torch.randn(n, k, device=dev, dtype=dt) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    ys = [torch.empty(n, device=dev, dtype=dt) for n, _ in SHAPES]
    x0 = torch.randn(1024, device=dev, dtype=dt)
    results, ref = {}, None
    for name, mode, pdl in [("cublas", -1, False), ("triton", 0, False), ("triton_pdl_wait_first", 1, True),
                            ("triton_pdl_weights_first", 2, True), ("triton_weights_first_no_pdl", 2, False)]:
        us = graph_us([functools.partial(chain, ws, ys, x0, mode, pdl)], replays=50)
        out = ys[-1].float().clone()
        ref = out if ref is None else ref
        results[name] = {"us_per_chain": us, "us_per_kernel": us / (LAYERS * len(SHAPES)),
                         "max_abs_diff_vs_cublas": (out - ref).abs().max().item()}
        print(f"{name:30s} {us:8.1f} us/chain  {us / (LAYERS * len(SHAPES)):5.2f} us/kernel")
    roofline = sum(n * k * 2 for n, k in SHAPES) * LAYERS / COPY_BW * 1e6
    print(f"{'roofline (weights / 4.27 TB/s)':30s} {roofline:8.1f} us/chain")
    results["roofline_us"] = roofline
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
