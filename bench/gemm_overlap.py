"""Whether a step's decode work hides under the GEMMs of other rows on a second stream (GPU).

    python bench/gemm_overlap.py [--layers 8] [--decodes 496] [--prompts 15] [--context 1100]
        [--carveouts 0 8 16 32] [--json bench/results/gemm_overlap.json]

The offline benchmark's steps are one of two kinds (Qwen3-8B, bench/RESULTS.md): a mixed
step, ~16k rows of prefill GEMMs (bound by tensor-core work, at the board's power limit)
with ~500 decodes whose attention is bound by KV reads (~19 ms of a ~390 ms step); and a
decode-only step of ~512 sequences, GEMMs (~11 ms) then attention (~21 ms) in every layer.
Within one forward the two never overlap: a layer's attention needs its qkv GEMM and its
o_proj needs the attention. Two micro-batches, each a forward of its own on its own stream,
could: one's attention beside the other's GEMMs. A mixed step would run its decodes as a
second forward, a decode-only step its two halves. This bench says what that would save,
before the engine is changed.

Per case, ``--layers`` Qwen3-8B layers (RMSNorm, qkv, attention, o_proj, RMSNorm, gate_up,
SiLU-and-mul, down; the engine's Triton kernels and cuBLAS GEMMs, bf16), timed as the median
of CUDA-event timings:

- ``engine``: what the engine does, one stream, every GEMM over all rows;
- ``split``: the two micro-batches one after the other on one stream (what splitting costs:
  the weights are read once more, the GEMMs are smaller);
- ``overlap c``: the two micro-batches on two streams, the second's whole forward queued
  after the first's. With c > 0 the first's GEMMs leave c SMs free
  (``torch._C._set_sm_carveout_experimental``) and the second's GEMMs target those c SMs;
  its Triton kernels take whatever SMs are free.

The GEMM alone under each carve-out is printed too, to show the carve-out took effect.

Measured on an H200 (bench/RESULTS.md, eighteenth session): two streams were slower than the
one forward in both cases (mixed 81.3 -> 85.8-86.4 ms, decode-only 6.99 -> 7.41-7.63), so the
engine keeps one forward a step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from atom_core.ops.triton.activation import silu_and_mul
from atom_core.ops.triton.decode_attention import num_kv_splits, paged_decode_attention
from atom_core.ops.triton.norm import rms_norm
from atom_core.ops.triton.prefill_attention import paged_prefill_attention

sys.path.insert(0, str(Path(__file__).parent))
from attention_overlap import HEAD_DIM, HEADS, KV_HEADS, make_step, time_us  # noqa: E402
from gpu_models import machine  # noqa: E402

HIDDEN, INTER = 4096, 12288  # Qwen3-8B
EPS = 1e-6


class Layer:
    """One layer's weights (shared by every timed layer: 386 MB does not stay in L2)."""

    def __init__(self, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device=device, dtype=dtype) * k**-0.5

        self.qkv = w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        self.o = w(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up = w(2 * INTER, HIDDEN)
        self.down = w(HIDDEN, INTER)
        self.norm = torch.ones(HIDDEN, device=device, dtype=dtype)


def carved(sms: int | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """F.linear with ``sms`` SMs carved out of cuBLAS's reach (None: all SMs)."""
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch._C._set_sm_carveout_experimental(sms)
        try:
            return F.linear(x, w)
        finally:
            torch._C._set_sm_carveout_experimental(None)
    return linear


def forward(layer: Layer, x: torch.Tensor, attend: Callable[[], None], attn_rows: torch.Tensor,
            layers: int, linear: Callable) -> None:
    """``layers`` layers over rows x; ``attend`` writes this micro-batch's attention rows
    (``attn_rows``, [rows, heads * head_dim]) from the step's q and cache."""
    for _ in range(layers):
        h = rms_norm(x, layer.norm, EPS)
        linear(h, layer.qkv)
        attend()
        x = x + linear(attn_rows, layer.o)
        h = rms_norm(x, layer.norm, EPS)
        x = x + linear(silu_and_mul(linear(h, layer.gate_up)), layer.down)


def time_ms(fn: Callable[[], None], iters: int = 3) -> float:
    return time_us(fn, iters) / 1e3


def two_streams(first: Callable[[], None], second: Callable[[], None], side: torch.cuda.Stream) -> Callable[[], None]:
    def call() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        first()
        with torch.cuda.stream(side):
            second()
        main.wait_stream(side)
    return call


def run_case(name: str, parts: list[dict], layer: Layer, args: argparse.Namespace, sms: int) -> dict:
    """``parts``: the two micro-batches, each {rows, attend, attn_rows}; the engine's single
    forward is their rows together with both attentions in its one attention slot."""
    rows = sum(p["rows"] for p in parts)
    x_all = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    out_all = torch.cat([p["attn_rows"] for p in parts])  # the engine's [rows, H*D] buffer

    def both_attend() -> None:
        for p in parts:
            p["attend"]()

    xs = [x_all[: parts[0]["rows"]], x_all[parts[0]["rows"]:]]
    full = carved(None)
    row: dict = {"case": name, "rows": [p["rows"] for p in parts]}
    row["engine_ms"] = time_ms(lambda: forward(layer, x_all, both_attend, out_all, args.layers, full))

    def split() -> None:
        for p, x in zip(parts, xs):
            forward(layer, x, p["attend"], p["attn_rows"], args.layers, full)

    row["split_ms"] = time_ms(split)
    side = torch.cuda.Stream()
    g = torch.randn(parts[0]["rows"], HIDDEN, device="cuda", dtype=torch.bfloat16)
    for c in args.carveouts:
        first_lin = carved(c or None)
        second_lin = carved(sms - c if c else None)
        call = two_streams(
            lambda lin=first_lin: forward(layer, xs[0], parts[0]["attend"], parts[0]["attn_rows"], args.layers, lin),
            lambda lin=second_lin: forward(layer, xs[1], parts[1]["attend"], parts[1]["attn_rows"], args.layers, lin),
            side)
        row[f"overlap_{c}_ms"] = time_ms(call)
        row[f"gate_up_{c}_ms"] = time_ms(lambda lin=first_lin: lin(g, layer.gate_up), iters=10)
    return row


def decode_part(step: dict, seqs: torch.Tensor, count: int, sms: int) -> dict:
    out = torch.empty_like(step["q"])
    splits = num_kv_splits(count, KV_HEADS, sms)
    first = int(seqs[0])  # decode rows are one a sequence, in sequence order

    def attend() -> None:
        paged_decode_attention(step["q"], step["kv_cache"], step["block_tables"], step["seq_lens"],
                               step["query_start_loc"], out, step["scale"], splits, seq_idx=seqs)

    return {"rows": count, "attend": attend, "attn_rows": out[first : first + count].view(count, -1)}


def prefill_part(step: dict, rows_before: int) -> dict:
    out = torch.empty_like(step["q"])

    def attend() -> None:
        paged_prefill_attention(step["q"], step["kv_cache"], step["block_tables"], step["seq_lens"],
                                step["query_start_loc"], step["prefills"], step["max_query_len"], out, step["scale"])

    rows = out.shape[0] - rows_before
    return {"rows": rows, "attend": attend, "attn_rows": out[rows_before:].view(rows, -1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--decodes", type=int, default=496, help="decodes beside the prompts in the mixed step")
    p.add_argument("--prompts", type=int, default=15)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-only", type=int, default=512, help="sequences of the decode-only step")
    p.add_argument("--context", type=int, default=1100)
    p.add_argument("--carveouts", nargs="+", type=int, default=[0, 8, 16, 32])
    p.add_argument("--blas", choices=["cublas", "cublaslt"], help="torch's preferred BLAS library (default: torch's)")
    p.add_argument("--json", default="bench/results/gemm_overlap.json")
    args = p.parse_args(argv)
    if min(args.layers, args.decodes, args.prompts, args.context) < 1 or args.prompt_len < 2:
        p.error("--layers, --decodes, --prompts and --context want at least 1, --prompt-len at least 2")
    if args.decode_only == 1 or args.decode_only < 0 or min(args.carveouts) < 0:
        p.error("--decode-only wants 0 (skip) or at least 2 sequences; --carveouts at least 0")
    return args


def main() -> int:
    args = parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    layer = Layer()
    rows = []
    # Mixed: the prompts' forward first (its GEMMs leave c SMs), the decodes' beside it.
    mixed = make_step(args.decodes, args.context, args.prompts, args.prompt_len)
    dec = decode_part(mixed, mixed["decodes"], args.decodes, sms)
    rows.append(run_case("mixed", [prefill_part(mixed, args.decodes), dec], layer, args, sms))
    del mixed
    # Decode-only: two halves, each a forward.
    only = make_step(args.decode_only, args.context, 0, 2) if args.decode_only else None
    if only is not None:
        half = args.decode_only // 2
        seqs = torch.arange(args.decode_only, device="cuda", dtype=torch.int32)
        parts = [decode_part(only, seqs[:half], half, sms), decode_part(only, seqs[half:], args.decode_only - half, sms)]
        rows.append(run_case("decode-only", parts, layer, args, sms))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=1))
    print(f"{args.layers} Qwen3-8B layers; ms (first micro-batch's gate_up alone under each carve-out)")
    for r in rows:
        cells = ", ".join(f"overlap {c}: {r[f'overlap_{c}_ms']:.3f} (gate_up {r[f'gate_up_{c}_ms']:.3f})"
                          for c in args.carveouts)
        print(f"{r['case']} rows {r['rows']}: engine {r['engine_ms']:.3f}, split {r['split_ms']:.3f}, {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
