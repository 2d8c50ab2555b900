"""Paged prefill/extend attention on one GPU: the Triton kernel vs torch's SDPA (flash
backend) on the same data.

    python bench/prefill_attention.py [--models qwen3-8b qwen3-0.6b] [--cases 16x1024 ...]
        [--budget-ms 250] [--no-sweep] [--sweep-case qwen3-8b:4x4096] [--sweep-tiles 64,64,4,3 ...]
        [--kv-dtype fp8] [--f16 0|1] [--block-size 16] [--tma 0|1]
        [--json bench/results/prefill_attention.json]

Each case is a batch of equal sequences in bf16, block size 16 (``--block-size``), blocks
handed out in shuffled order: fresh prefills (16 x 1024, 4 x 4096, 1 x 16384 tokens) and an extend
(8 x 1024 new tokens over a 3072-token cached prefix). SDPA runs on the same K/V laid out
contiguously, [B, H, L, D], with the kv heads repeated to the query heads (a copy made
outside the timing), ``is_causal`` for fresh prefills and a lower-right causal bias
(flash's own causal alignment) for the extend.

TFLOP/s counts causal work only: 4 * sum over sequences of (q_len * ctx + q_len^2 / 2) *
heads * head_dim, ctx the cached prefix. Each kernel's output is compared with SDPA's (max
abs diff); a mismatch is printed, recorded and makes the exit status 1, so a wrong kernel
cannot pass for a fast one. Time: GPU time a call, from calls back to back in one CUDA
graph (median of 7 replays, about --budget-ms of calls), so that a small case is not timed
by its launch's host cost; every call reads the same inputs, so a small case's K/V sit in
L2, as a step's just-written chunk does. Then the new kernel is timed on one case under a few other
tile configs (SWEEP), to show whether the one it picks is the best on this GPU. About a
minute on an H200, most of it Triton compiling.

``--kv-dtype fp8`` stores the cache in e4m3 (``--kv_cache_dtype fp8``; SDPA reads the same
values dequantized), and ``--f16 0`` / ``1`` forces the kernel's fp16 compute of an fp8
cache off or on; ``--tma 0`` / ``1`` its TMA loads of K/V (pages of 64 tokens or more).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
from atom_kernels_triton.prefill_attention import paged_prefill_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import event_seconds, graph_us, write_json  # noqa: E402

MODELS = {"qwen3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}  # (heads, kv heads, head dim)
CASES = {  # (sequences, new tokens each, cached prefix each)
    "16x1024": (16, 1024, 0),
    "4x4096": (4, 4096, 0),
    "1x16384": (1, 16384, 0),
    "extend-8x1024+3072": (8, 1024, 3072),
    # A prompt's chunks beside running decodes (--mixed-prefill-tokens): small grids.
    "1x448": (1, 448, 0),
    "1x1024": (1, 1024, 0),
    "4x512": (4, 512, 0),
    "2x1024": (2, 1024, 0),
    "extend-1x256+256": (1, 256, 256),
}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
# Other (BLOCK_M, BLOCK_N, num_warps, num_stages) for the new kernel, timed on one case to
# show whether the chosen tiles are the best on this GPU (all compile for sm_90 without
# spills; 128x128 sits at 255 registers).
SWEEP = [(128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3)]
MAX_ABS_DIFF = 2e-2  # bf16 outputs of unit-variance inputs; a wrong mask is off by ~1e-1


def causal_flops(query_lens: list[int], prefix_lens: list[int], heads: int, head_dim: int) -> float:
    """QK^T and PV over the visible keys: each query sees its prefix and the new tokens up
    to itself (q_len^2 / 2, the diagonal's half counted as FlashAttention counts it)."""
    pairs = sum(q * c + q * q / 2 for q, c in zip(query_lens, prefix_lens))
    return 4.0 * pairs * heads * head_dim


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--budget-ms", type=float, default=250.0,
                   help="timed run time per kernel per case")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the new kernel with the SWEEP tile configs on --sweep-case")
    p.add_argument("--sweep-case", default="qwen3-8b:4x4096", help="MODEL:CASE")
    p.add_argument("--sweep-tiles", nargs="+", metavar="M,N,WARPS,STAGES",
                   help="tile configs to sweep instead of SWEEP "
                        "(BLOCK_M,BLOCK_N,num_warps,num_stages)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--f16", type=int, choices=(0, 1), default=None,
                   help="force the kernel's fp16 compute of an fp8 cache off or on")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help="the cache's tokens per block (--block-size of the engine)")
    p.add_argument("--tma", type=int, choices=(0, 1), default=None,
                   help="force the kernel's TMA loads of K/V off or on (on: where the pages "
                        "hold whole tiles)")
    p.add_argument("--json", default="bench/results/prefill_attention.json")
    args = p.parse_args(argv)
    model, _, case = args.sweep_case.partition(":")
    if model not in MODELS or case not in CASES:
        p.error(f"--sweep-case {args.sweep_case!r}: want MODEL:CASE from {list(MODELS)} "
                f"and {list(CASES)}")
    try:
        args.sweep_tiles = [tuple(int(v) for v in t.split(",", 3))
                            for t in args.sweep_tiles or []] or SWEEP
    except ValueError:
        p.error(f"--sweep-tiles {args.sweep_tiles}: want M,N,WARPS,STAGES integers")
    if any(len(t) != 4 for t in args.sweep_tiles):
        p.error(f"--sweep-tiles {args.sweep_tiles}: want four integers each")
    return args


def make_case(model: str, case: str, seed: int = 0, dev: str = "cuda",
              cache_dtype: torch.dtype = DTYPE, block_size: int = BLOCK_SIZE) -> dict:
    """The paged inputs of one case and the same data contiguous for SDPA."""
    heads, kv_heads, head_dim = MODELS[model]
    batch, q_len, prefix = CASES[case]
    seq_len = prefix + q_len
    per_seq = triton.cdiv(seq_len, block_size)
    g = torch.Generator(device=dev).manual_seed(seed)
    tables = torch.randperm(batch * per_seq, generator=g, device=dev).view(batch, per_seq)
    cache = torch.randn(2, batch * per_seq, block_size, kv_heads, head_dim, generator=g,
                        device=dev, dtype=DTYPE).to(cache_dtype)
    q = torch.randn(batch * q_len, heads, head_dim, generator=g, device=dev, dtype=DTYPE)

    def contiguous(kv: torch.Tensor) -> torch.Tensor:  # [B, heads, seq_len, D]
        seqs = kv[tables].to(DTYPE).view(batch, per_seq * block_size, kv_heads, head_dim)
        seqs = seqs[:, :seq_len]
        return seqs.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1).contiguous()

    return {
        "q": q, "cache": cache, "block_tables": tables.int(),
        "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32, device=dev),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=dev) * q_len,
        "seq_idx": torch.arange(batch, dtype=torch.int32, device=dev),
        "max_query_len": q_len, "scale": head_dim**-0.5,
        "sdpa_q": q.view(batch, q_len, heads, head_dim).transpose(1, 2).contiguous(),
        "sdpa_k": contiguous(cache[0]), "sdpa_v": contiguous(cache[1]),
        "flops": causal_flops([q_len] * batch, [prefix] * batch, heads, head_dim),
    }


def sdpa_runner(c: dict):
    """(SDPA call on c's contiguous data, backend label): flash, or what torch picks if
    flash refuses the shape here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = c["sdpa_q"], c["sdpa_k"], c["sdpa_v"]
    lower_right = q.shape[2] != k.shape[2]
    mask = causal_lower_right(q.shape[2], k.shape[2]) if lower_right else None

    def call():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not lower_right, scale=c["scale"])

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            call()

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return call()
        return flash, "sdpa-flash"
    except RuntimeError as exc:
        print(f"  SDPA flash refused this case ({str(exc).splitlines()[0]}); using torch's pick")
        return call, "sdpa-default"


def time_ms(fn, budget_ms: float) -> float:
    """Milliseconds of GPU time a call of ``fn``: calls back to back in one CUDA graph, the
    median of 7 replays, about ``budget_ms`` of calls in all. Not events around single
    calls: a small case's kernel is shorter than its launch's host time, which events
    around an eager call would count."""
    once_ms = event_seconds(fn, reps=1, warmup=1) * 1e3  # compiles; an upper bound
    calls = max(2, min(64, int(budget_ms / 7 / max(once_ms, 1e-3))))
    return graph_us([fn] * calls) / 1e3


def prepared(model: str, case: str, cache_dtype: torch.dtype, block_size: int):
    """(case data, kernel arguments with a fresh output, SDPA call, its label, SDPA's output
    in the kernels' [T, H, D] layout)."""
    c = make_case(model, case, cache_dtype=cache_dtype, block_size=block_size)
    out = torch.empty_like(c["q"])
    args = (c["q"], c["cache"], c["block_tables"], c["seq_lens"], c["query_start_loc"],
            c["seq_idx"], c["max_query_len"], out, c["scale"])
    sdpa, peer = sdpa_runner(c)
    return c, args, sdpa, peer, sdpa().transpose(1, 2).reshape(out.shape).float()


def max_abs_diff(kernel, args, ref: torch.Tensor, out: torch.Tensor | None = None) -> float:
    out = args[7] if out is None else out
    out.fill_(float("nan"))
    kernel(*args)
    return float((out.float() - ref).abs().max())  # NaN if a row is left unwritten


def run_case(model: str, case: str, budget_ms: float, cache_dtype: torch.dtype,
             opts: dict, block_size: int) -> dict:
    c, args, sdpa, peer, ref = prepared(model, case, cache_dtype, block_size)
    kernel = functools.partial(paged_prefill_attention, **opts)
    row = {"model": model, "case": case, "peer": peer, "flops": c["flops"]}
    row["new_max_abs_diff"] = max_abs_diff(kernel, args, ref)
    row["new_ms"] = time_ms(lambda: kernel(*args), budget_ms)
    row["sdpa_ms"] = time_ms(sdpa, budget_ms)
    for name in ("new", "sdpa"):
        row[f"{name}_tflops"] = c["flops"] / row[f"{name}_ms"] / 1e9
    row["new_vs_sdpa"] = row["sdpa_ms"] / row["new_ms"]  # > 1: the kernel is faster
    row["ok"] = row["new_max_abs_diff"] <= MAX_ABS_DIFF
    return row


def sweep(model: str, case: str, budget_ms: float, configs: list[tuple[int, int, int, int]],
          cache_dtype: torch.dtype, opts: dict, block_size: int) -> list[dict]:
    """The new kernel under each tile config (what it picks for the case first); a config
    that fails to compile or run is recorded, not fatal."""
    c, args, _, _, ref = prepared(model, case, cache_dtype, block_size)
    rows = []
    for tiles in [None, *configs]:
        call = functools.partial(paged_prefill_attention, *args, tile=tiles, **opts)
        row = {"model": model, "case": case, "tiles": list(tiles or []), "shipped": not rows}
        try:
            row["max_abs_diff"] = max_abs_diff(call, (), ref, args[7])
            row["ms"] = time_ms(call, budget_ms)
            row["tflops"] = c["flops"] / row["ms"] / 1e9
            label = ("what it picks" if tiles is None else
                     f"BLOCK_M {tiles[0]:>3} BLOCK_N {tiles[1]:>3} warps {tiles[2]} "
                     f"stages {tiles[3]}")
            print(f"  {label:<44}: {row['ms']:8.4f} ms {row['tflops']:7.1f} TFLOP/s  "
                  f"max|d| {row['max_abs_diff']:.2e}")
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory on this GPU
            first = str(exc).splitlines()[0] if str(exc) else ""
            row["error"] = f"{type(exc).__name__}: {first}"
            print(f"  {tiles}: {row['error']}")
        rows.append(row)
    return rows


def write(path: Path, args: argparse.Namespace, rows: list[dict], sweep_rows: list[dict]
          ) -> None:
    write_json(path, {"triton": triton.__version__, "block_size": args.block_size,
                      "dtype": str(DTYPE), "kv_dtype": args.kv_dtype, "f16": args.f16,
                      "tma": args.tma,
                      "results": rows, "sweep": sweep_rows})


def main() -> int:
    args = parse_args()
    cache_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else DTYPE
    opts = {name: None if getattr(args, name) is None else bool(getattr(args, name))
            for name in ("f16", "tma")}
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name(0)}  torch {torch.__version__}  "
          f"triton {triton.__version__}  {DTYPE}, cache {cache_dtype}, "
          f"block size {args.block_size}")
    print(f"{'model':<11} {'case':<19} {'new ms':>8} {'sdpa ms':>8} "
          f"{'new TF/s':>8} {'sdpa TF/s':>9} {'vs sdpa':>7} {'max|d|':>8}")
    rows = []
    for model in args.models:
        for case in args.cases:
            r = run_case(model, case, args.budget_ms, cache_dtype, opts, args.block_size)
            rows.append(r)
            flag = "" if r["ok"] else "  MISMATCH"
            print(f"{model:<11} {case:<19} {r['new_ms']:8.4f} {r['sdpa_ms']:8.4f} "
                  f"{r['new_tflops']:8.1f} {r['sdpa_tflops']:9.1f} "
                  f"{r['new_vs_sdpa']:6.2f}x {r['new_max_abs_diff']:8.2e}{flag}")
            torch.cuda.empty_cache()
    path = Path(args.json)
    write(path, args, rows, [])  # kept even if the sweep below dies
    sweep_rows = []
    if args.sweep:
        model, case = args.sweep_case.split(":")
        print(f"tile sweep, new kernel, {model} {case}:")
        sweep_rows = sweep(model, case, args.budget_ms, args.sweep_tiles, cache_dtype, opts,
                           args.block_size)
        write(path, args, rows, sweep_rows)
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
