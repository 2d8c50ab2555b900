"""gpt-oss's experts in MXFP4 against the same experts in bf16, by step size: where the
4-bit weight-only kernel stops paying (the ``GPTOSS_SWIGLU_MXFP4_BF16_BOUND`` question).

    python bench/mxfp4_moe.py [--model gpt-oss-20b] [--tokens 1 4 16 ... 8192]
        [--sweep] [--table PATH] [--json bench/results/mxfp4_moe.json]
    python bench/mxfp4_moe.py --dry-run    # CPU: the plan, and both stacks once, small

For each step size T, the Triton ``clamped_swiglu_moe`` op (atom-kernels-triton) on one
layer's routed experts at the model's shape (E experts, top-k, hidden H, intermediate I),
softmax-top-k routing of random logits, timed as a CUDA graph of calls that cycle through
enough weight copies to miss L2 (median replay), twice: with the experts as MXFP4 stacks
(random codes and e8m0 scales, decoded in registers) and as bf16 stacks holding the same
values. Each line gives both in us, the bytes of the experts the step touched over the time
(TB/s), the GEMMs' TFLOP/s, and MXFP4's time over bf16's. The two outputs are compared
(the same values, so they differ only by accumulation order and rounding).

The bound the blog's rule asks for is where quantized activations would start to gain: on
a GPU without FP4 tensor cores (H100/H200) the 4-bit weights are decoded to bf16 in
registers either way, so what the sweep shows is the token count from which the decode's
cost outweighs the bytes it saves (``crossover``: the smallest T from which the bf16 stacks
are at least as fast at every larger T measured), past which a kernel would need more
than weight-only MXFP4 to gain.

``--sweep`` times candidate tiles of the MXFP4 op at each T and writes the fastest into
the device's table (``atom_kernels_triton/configs/clamped_swiglu_moe/<device>.json``, or
``--table``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

if "--dry-run" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from atom_kernels_triton import tuning  # noqa: E402
from atom_kernels_triton.clamped_swiglu_moe import (  # noqa: E402
    OP,
    TILE_SPACE,
    clamped_swiglu_moe,
)
from atom_kernels_triton.fused_moe_config import MoeConfig, get_config  # noqa: E402
from common import graph_us, load_config, rel_err, write_json  # noqa: E402

from atom_core.quant.mxfp4 import BLOCK, Mxfp4Weight, dequantize  # noqa: E402

TOKENS = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
TOLERANCE = 1.6e-2  # bf16 outputs of the same values, summed in another order


def model_shape(name: str) -> tuple[int, int, int, int, float, float]:
    """(experts, top-k, hidden, intermediate, alpha, limit) of a gpt-oss config."""
    cfg = load_config(name)
    return (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"],
            cfg["intermediate_size"], float(cfg.get("swiglu_alpha", 1.702)),
            float(cfg.get("swiglu_limit", 7.0)))


def random_mxfp4(experts: int, n: int, k: int, g: torch.Generator, device: str) -> Mxfp4Weight:
    """Random codes; scales 2**-4..2**-1, so the values stay within a layer's usual range."""
    blocks = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8,
                           device="cpu").to(device)
    scales = torch.randint(123, 127, (experts, n, k // BLOCK), generator=g, dtype=torch.uint8,
                           device="cpu").to(device)
    return Mxfp4Weight(blocks, scales)


def routing(tokens: int, experts: int, top_k: int, g: torch.Generator, device: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=g).to(device)
    top, ids = logits.topk(top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids.to(torch.int32)


def candidates(tokens: int, top_k: int, experts: int) -> list[MoeConfig]:
    rows = max(1.0, tokens * top_k / experts)
    max_m = max(16, 4 * 2 ** math.ceil(math.log2(rows)))  # taller tiles are mostly padding
    return [MoeConfig(zip(TILE_SPACE, values))
            for values in itertools.product(*TILE_SPACE.values())
            if values[0] <= max_m]


def crossover(results: list[dict[str, Any]]) -> int | None:
    """The smallest T from which bf16 is at least as fast as MXFP4 at every larger T."""
    found = None
    for r in sorted(results, key=lambda r: -r["tokens"]):
        if r["bf16_us"] > r["mxfp4_us"]:
            break
        found = r["tokens"]
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    experts, top_k, hidden, inter, alpha, limit = model_shape(args.model)
    g = torch.Generator().manual_seed(0)
    expert_bytes = {"mxfp4": 3 * inter * hidden * (0.5 + 1 / BLOCK),
                    "bf16": 3 * inter * hidden * 2}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(1, math.ceil(4 * l2 / (experts * expert_bytes["mxfp4"])))
    mx = [(random_mxfp4(experts, 2 * inter, hidden, g, "cuda"),
           random_mxfp4(experts, hidden, inter, g, "cuda")) for _ in range(copies)]
    bf = [(w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)) for w13, w2 in mx]
    b13 = (torch.randn(experts, 2 * inter, generator=g) * 0.1).to("cuda", torch.bfloat16)
    b2 = (torch.randn(experts, hidden, generator=g) * 0.1).to("cuda", torch.bfloat16)
    print(f"{args.model}: E={experts} top-{top_k} H={hidden} I={inter}, {copies} weight "
          f"copies; us, TB/s of the touched experts, TFLOP/s")
    results, best_tiles = [], {}
    for t in args.tokens:
        x = torch.randn(t, hidden, generator=g).to("cuda", torch.bfloat16)
        weights, ids = routing(t, experts, top_k, g, "cuda")
        touched = int(ids.unique().numel())
        flop = 2 * t * top_k * 3 * inter * hidden

        def op(stacks, config=None, x=x, weights=weights, ids=ids):
            return lambda: clamped_swiglu_moe(x, stacks[0], b13, stacks[1], b2, weights, ids,
                                              alpha, limit, config=config)

        r: dict[str, Any] = {"tokens": t, "experts_touched": touched, "flop": flop,
                             "err": rel_err(op(mx[0])(), op(bf[0])())}
        for name, stacks in (("mxfp4", mx), ("bf16", bf)):
            us = graph_us([op(stacks[i % copies]) for i in range(args.calls)])
            r[f"{name}_us"] = us
            r[f"{name}_tbs"] = touched * expert_bytes[name] / us / 1e6
        r["config"] = dict(get_config(t, top_k, experts, hidden, inter,
                                      tuning.table_for(OP, x.device)))
        print(f"T={t:5d} ({touched:2d} experts): mxfp4 {r['mxfp4_us']:9.1f} us "
              f"{r['mxfp4_tbs']:5.2f} TB/s {flop / r['mxfp4_us'] / 1e6:5.0f} TF/s | bf16 "
              f"{r['bf16_us']:9.1f} us {r['bf16_tbs']:5.2f} TB/s "
              f"{flop / r['bf16_us'] / 1e6:5.0f} TF/s | mxfp4/bf16 "
              f"{r['mxfp4_us'] / r['bf16_us']:.2f} | err {r['err']:.1e}", flush=True)
        if args.sweep:
            r["sweep"] = sweep(t, top_k, experts, op, mx, copies, args.calls)
            best_tiles[t] = r["sweep"]["best"]
        results.append(r)
    out = {"model": args.model, "shape": [experts, top_k, hidden, inter],
           "crossover": crossover(results), "results": results}
    print(f"bf16 stacks at least as fast as MXFP4 from T = {out['crossover']}")
    if best_tiles:
        write_table(args, hidden, inter, best_tiles)
    return out


def sweep(t: int, top_k: int, experts: int, op, mx, copies: int, calls: int) -> dict[str, Any]:
    ref = op(mx[0])()
    rows = []
    for c in candidates(t, top_k, experts):
        try:
            if rel_err(op(mx[0], c)(), ref) >= TOLERANCE:
                continue
            us = graph_us([op(mx[i % copies], c) for i in range(calls)])
        except Exception as e:  # out of shared memory / registers at compile time
            print(f"  T={t} {dict(c)}: {type(e).__name__}, skipped", flush=True)
            continue
        rows.append({**c, "us": us})
    best = min(rows, key=lambda r: r["us"])
    print(f"  sweep T={t}: best {best['us']:.1f} us {best}", flush=True)
    return {"best": {k: v for k, v in best.items() if k != "us"}, "best_us": best["us"],
            "all": rows}


def write_table(args: argparse.Namespace, hidden: int, inter: int,
                best: dict[int, dict[str, Any]]) -> None:
    device = tuning.device_name()
    table = {shape: dict(b) for shape, b in tuning.load(OP, device).configs.items()}
    table.setdefault((hidden, inter), {}).update({t: MoeConfig(c) for t, c in best.items()})
    path = args.table or tuning.table_path(OP, device)
    producer = " ".join(["python bench/mxfp4_moe.py", *sys.argv[1:]])
    tuning.dump(path, device, table, producer, in_model=[])
    print(f"wrote {path}")


def dry_run(model: str) -> None:
    """On CPU: the plan, and the op once on both stacks, scaled down (the interpreter)."""
    experts, top_k, hidden, inter, alpha, limit = model_shape(model)
    print(f"{model}: E={experts} top-{top_k} H={hidden} I={inter}; tokens {TOKENS}")
    g = torch.Generator().manual_seed(0)
    e, h, i = 4, 64, 64
    w13, w2 = random_mxfp4(e, 2 * i, h, g, "cpu"), random_mxfp4(e, h, i, g, "cpu")
    x = torch.randn(3, h, generator=g).half()
    weights, ids = routing(3, e, 2, g, "cpu")
    mx = clamped_swiglu_moe(x, w13, None, w2, None, weights, ids, alpha, limit)
    bf = clamped_swiglu_moe(x, dequantize(w13.blocks, w13.scales, torch.float16), None,
                            dequantize(w2.blocks, w2.scales, torch.float16), None, weights, ids,
                            alpha, limit)
    print(f"  E={e} H={h} I={i} T=3: MXFP4 against the same values in fp16, rel err "
          f"{rel_err(mx, bf):.1e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--calls", type=int, default=8, help="calls per CUDA graph")
    ap.add_argument("--sweep", action="store_true",
                    help="time candidate tiles of the MXFP4 op and write the fastest")
    ap.add_argument("--table", type=Path, help="the table to write (default: the package's)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the plan, small")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "mxfp4_moe.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args.model)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/mxfp4_moe.py needs a CUDA GPU (--dry-run runs on CPU)")
    print(f"wrote {write_json(args.json, run(args))}")


if __name__ == "__main__":
    main()
