"""Sweep the Triton fused_moe block configs on a GPU and report the fastest per batch size.

    python bench/tune_fused_moe.py [--models qwen3-30b-a3b deepseek-v2-lite]
        [--shape E,K,H,I[,S] ...] [--tp 1] [--batch-sizes 1 2 4 ... 4096] [--dtype bf16]
        [--block-m 16 32 ...] [--block-n ...] [--block-k ...] [--warps ...] [--stages ...]
        [--overlap] [--fp8 weight-only|w8a8] [--no-graph]
        [--json bench/results/fused_moe_tuning.json] [--table PATH]

Shapes come from ``bench/configs/<model>/config.json`` (routed experts, top-k, hidden,
moe_intermediate_size / tp, shared experts) or ``--shape``. Shared experts (DeepSeek's)
run as the op runs them in the model: S more stacked experts that every token takes, so
each holds T rows, not T*k/E. Each config is timed on the whole op
(alignment, both kernels, the k-sum), replayed from a CUDA graph by default since decode
runs that way, on softmax-top-k routing of random logits; a config whose output is off
the native reference, or that does not compile (shared memory), is skipped. Prints the
best per batch size and writes it into the device's table
(``atom_kernels_triton/configs/fused_moe/<device>.json``, or ``--table``), keeping the
entries the file lists in ``in_model``: the launch forms (``PERSISTENT``, ``OVERLAP``) and
buckets chosen by timing the model, not here. ``--json`` keeps every timing. ``--overlap``
times every candidate with ``OVERLAP`` on, as the decode buckets past one token run.
``--fp8 FORMAT`` sweeps e4m3 stacks (quantized per row from the --dtype weights, as
``--quantization fp8`` loads them) in that GEMM format at every batch size, against the
native op on the same stacks, and writes the table's (H, I, FORMAT) entries, which fp8
launches of that format take before the model dtype's (fused_moe_config).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from atom_kernels_triton import fused_moe_config, tuning  # noqa: E402
from atom_kernels_triton.fused_moe import fused_moe  # noqa: E402
from atom_kernels_triton.fused_moe_config import OP, MoeConfig, MoeTable, tuned  # noqa: E402
from atom_kernels_triton.fused_moe_fp8 import W8A8, fp8_mode  # noqa: E402
from common import rel_err  # noqa: E402

from atom_core.ops.native.moe import fused_moe as native_fused_moe  # noqa: E402
from atom_core.quant.fp8 import quantize_weight  # noqa: E402

BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
# --fp8: the table's format number, and the stacks' w8a8_min_rows that runs every size in it.
FP8_FORMATS = {"weight-only": (fused_moe_config.WEIGHT_ONLY, 2**30),
               "w8a8": (fused_moe_config.W8A8, 1)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB per block; keep a little slack
DEVICE = "cuda"


def model_shape(name: str, tp: int) -> tuple[int, int, int, int, int]:
    cfg = json.loads((ROOT / "bench" / "configs" / name / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["n_routed_experts"]
    shared = cfg.get("n_shared_experts") or 0
    inter = cfg["moe_intermediate_size"] // tp
    return experts, cfg["num_experts_per_tok"], cfg["hidden_size"], inter, shared


SPACE = {"block_m": (16, 32, 64, 128), "block_n": (32, 64, 128, 256), "block_k": (64, 128, 256),
         "warps": (4, 8), "stages": (2, 3, 4)}


def candidates(num_tokens: int, top_k: int, experts: int, elem_bytes: int, shared: int = 0,
               space: dict = SPACE, weight_bytes: int | None = None) -> list[MoeConfig]:
    """The space's tiles that fit shared memory (rows of ``elem_bytes``, weights of
    ``weight_bytes``, default the same) and are not mostly padding."""
    weight_bytes = elem_bytes if weight_bytes is None else weight_bytes
    rows_per_expert = max(num_tokens * top_k / experts, num_tokens if shared else 0)
    # Tiles much taller than an expert's rows are mostly padding: don't bother. (4x, not 2x:
    # Qwen3-30B-A3B's 512-token decode steps ran faster on 128-row tiles, 32 rows an expert.)
    max_m = max(16, 4 * 2 ** math.ceil(math.log2(max(rows_per_expert, 1))))
    out = []
    for m, n, k, warps, stages in itertools.product(
        space["block_m"], space["block_n"], space["block_k"], space["warps"], space["stages"]
    ):
        # gate_up streams one A tile and two weight tiles per stage.
        if m > max_m or stages * (m * k * elem_bytes + 2 * k * n * weight_bytes) > SMEM_BYTES:
            continue
        # Pruned to keep the sweep to minutes; widen here to search further.
        if (n == 256 and warps == 4) or (k == 256 and m >= 64):
            continue
        out.append(MoeConfig(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages))
    return out


def time_ms(fn, graph: bool) -> float:
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=20)
    return triton.testing.do_bench(fn, warmup=5, rep=20)


def tune_shape(shape, batch_sizes, dtype, graph: bool, space: dict = SPACE,
               overlap: bool = False, fp8_min_rows: int | None = None) -> dict[int, dict]:
    """``fp8_min_rows``: the stacks quantized to e4m3, W8A8 from that many tokens."""
    experts, top_k, hidden, inter, shared = shape
    g = torch.Generator(device=DEVICE).manual_seed(0)
    stacked = experts + shared
    w13 = torch.randn(stacked, 2 * inter, hidden, device=DEVICE, generator=g) / hidden**0.5
    w13 = w13.to(dtype)
    w2 = (torch.randn(stacked, hidden, inter, device=DEVICE, generator=g) / inter**0.5).to(dtype)
    if fp8_min_rows is not None:
        w13, w2 = quantize_weight(w13, fp8_min_rows), quantize_weight(w2, fp8_min_rows)
    weight_bytes = 1 if fp8_min_rows is not None else None
    results = {}
    for tokens in batch_sizes:
        x = torch.randn(tokens, hidden, device=DEVICE, generator=g).to(dtype)
        logits = torch.randn(tokens, experts, device=DEVICE, generator=g)
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ref = native_fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared)
        timings, start = [], time.time()
        w8a8 = fp8_mode(w13, tokens) == W8A8  # x quantized: a byte a value
        for config in candidates(tokens, top_k, experts, 1 if w8a8 else x.element_size(),
                                 shared, space, weight_bytes):
            if overlap:
                config = MoeConfig({**config, "OVERLAP": True})
            try:
                out = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=config)
                err = rel_err(out, ref)
                if err >= TOLERANCE[dtype]:
                    print(f"  T={tokens} {config}: rel err {err:.2e}, skipped", flush=True)
                    continue
                run = functools.partial(fused_moe, x, w13, w2, weights, ids,
                                        num_shared_experts=shared, config=config)
                ms = time_ms(run, graph)
            except Exception as e:  # out of shared memory / registers at compile time
                print(f"  T={tokens} {config}: {type(e).__name__}, skipped", flush=True)
                continue
            timings.append((ms, config))
        if not timings:
            sys.exit(f"T={tokens}: no config compiled and matched the reference")
        timings.sort(key=lambda t: t[0])
        best_ms, best = timings[0]
        native_ms = time_ms(functools.partial(native_fused_moe, x, w13, w2, weights, ids,
                                              num_shared_experts=shared), False)
        print(
            f"E={experts}+{shared} k={top_k} H={hidden} I={inter} T={tokens:5d}: "
            f"{best_ms * 1e3:8.1f} us "
            f"{best}  ({len(timings)} configs in {time.time() - start:.0f} s; native eager "
            f"{native_ms * 1e3:.1f} us)",
            flush=True,
        )
        results[tokens] = {"best": best, "best_us": best_ms * 1e3, "native_us": native_ms * 1e3,
                           "all": [{"us": ms * 1e3, **c} for ms, c in timings]}
    return results


def parse_shape(spec: str) -> tuple[int, int, int, int, int]:
    values = [int(v) for v in spec.split(",")]
    if len(values) not in (4, 5):
        raise SystemExit(f"--shape {spec!r}: expected E,K,H,I or E,K,H,I,S")
    return (*values, 0) if len(values) == 4 else tuple(values)  # type: ignore[return-value]


def new_table(
    table: MoeTable, in_model: frozenset[tuple[int, ...]],
    measured: dict[tuple[int, ...], dict[int, dict]],
) -> MoeTable:
    """``table`` with the best config of each measured key ((H, I), or (H, I, fp8 format))
    and token bucket put in; the entries chosen in the model (``in_model``) stay as they
    are."""
    out = {shape: dict(buckets) for shape, buckets in table.items()}
    for shape, results in measured.items():
        for tokens, r in results.items():
            if (*shape, tokens) not in in_model:
                out.setdefault(shape, {})[tokens] = MoeConfig(**r["best"])
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="*", default=["qwen3-30b-a3b", "deepseek-v2-lite"])
    ap.add_argument("--shape", nargs="*", default=[],
                    help="E,K,H,I[,S] (routed experts, top-k, hidden, inter, shared experts)")
    ap.add_argument("--tp", type=int, default=1, help="divides the models' intermediate size")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=BATCH_SIZES)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    for name, values in SPACE.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+", default=list(values),
                        help=f"candidate values (default: {' '.join(map(str, values))})")
    ap.add_argument("--overlap", action="store_true",
                    help="every candidate with OVERLAP (fused_moe_config)")
    ap.add_argument("--fp8", choices=sorted(FP8_FORMATS),
                    help="sweep e4m3 stacks in this format; writes the (H, I, format) entries")
    ap.add_argument("--no-graph", action="store_true", help="time eager launches, not graph replay")
    ap.add_argument("--json", type=Path,
                    default=ROOT / "bench" / "results" / "fused_moe_tuning.json")
    ap.add_argument("--table", type=Path,
                    help="the table file to write (default: the package's for this device)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_fused_moe.py needs a CUDA/ROCm GPU")
    shapes = [model_shape(m, args.tp) for m in args.models]
    shapes += [parse_shape(s) for s in args.shape]
    space = {name: tuple(getattr(args, name)) for name in SPACE}
    dtype = DTYPES[args.dtype]
    device = torch.cuda.get_device_name()
    report = {"device": device, "dtype": args.dtype, "fp8": args.fp8, "shapes": {}}
    fp8_format, fp8_min_rows = FP8_FORMATS[args.fp8] if args.fp8 else (0, None)
    measured = {}
    for shape in shapes:
        results = tune_shape(shape, args.batch_sizes, dtype, graph=not args.no_graph, space=space,
                             overlap=args.overlap, fp8_min_rows=fp8_min_rows)
        key = "E={},k={},H={},I={},shared={}".format(*shape)
        report["shapes"][key] = {str(t): r for t, r in results.items()}
        measured[(shape[2], shape[3], fp8_format) if fp8_format else shape[2:4]] = results
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    in_model = tuning.in_model(OP, device)
    table = new_table(tuned(device), in_model, measured)
    path = args.table or tuning.table_path(OP, device)
    producer = " ".join(["python bench/tune_fused_moe.py", *argv])
    tuning.dump(path, device, table, producer, in_model=sorted(list(e) for e in in_model))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
