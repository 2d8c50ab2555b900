"""A mixed step's two attention launches, one after the other and side by side (GPU).

    python bench/attention_overlap.py [--decodes 128 256 496] [--context 1100] [--prompts 15]
        [--prompt-len 1024] [--iters 20] [--json bench/results/attention_overlap.json]

In a mixed step of the offline benchmark (Qwen3-8B, 16,384 tokens a step, ~500 sequences
decoding beside 15-16 new prompts) every layer runs the decode kernel over the decodes'
cached contexts, which is bound by its KV reads (~19 ms of a ~390 ms step at ~500 decodes),
then the prefill kernel over the new prompts, which is bound by tensor-core work (~27 ms).
Nothing flows between the two: they write disjoint rows of one output. The engine launches
them in series on one stream (``TritonAttentionBackend.forward``). On two streams the
prefill's matrix work and the decodes' memory traffic could share the SMs; this bench says
how much of the decode kernel's time that would hide, before the engine is changed.

Per case (the decode count), one layer's inputs laid out as the engine lays them out
(decodes' rows first, then the prompts', one paged cache with blocks in shuffled order,
Qwen3-8B heads in bf16), timed as the median of CUDA-event timings of ``--iters`` calls:
each kernel alone; the two in series; the two side by side, the decode kernel on a second
stream at high priority (so its programs are placed as the prefill's retire) and at normal
priority. Beside them: the series time less the longer of the two alone (the most overlap
could save) and the decodes' KV bytes at the copy bandwidth measured in the same run. The
side-by-side output must equal the serial one bit for bit (same kernels, disjoint rows);
a mismatch is printed and makes the exit status 1.

Measured on an H200 (bench/RESULTS.md, seventeenth session): side by side saved at most 1%
of the series time at 128-496 decodes, so the engine keeps one stream.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path

import torch

from atom_core.engine.step_inputs import eager_inputs
from atom_core.layers.attention.triton_backend import TritonAttentionBackend
from atom_core.ops.triton.decode_attention import num_kv_splits, paged_decode_attention
from atom_core.ops.triton.prefill_attention import paged_prefill_attention

sys.path.insert(0, str(Path(__file__).parent))
from gpu_models import copy_bandwidth, machine  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
BLOCK_SIZE = 16


def make_step(decodes: int, context: int, prompts: int, prompt_len: int, *, device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16, heads: int = HEADS, kv_heads: int = KV_HEADS,
              head_dim: int = HEAD_DIM, seed: int = 0) -> dict:
    """One layer's attention inputs of a mixed step: ``decodes`` sequences of ``context``
    tokens computing their last, then ``prompts`` fresh prompts of ``prompt_len`` tokens.
    The metadata and the decode/prefill split come from the engine's own builders
    (``eager_inputs``, the Triton backend's plan), blocks handed out in shuffled order."""
    g = torch.Generator(device=device).manual_seed(seed)
    starts = [context - 1] * decodes + [0] * prompts
    counts = [1] * decodes + [prompt_len] * prompts
    per_seq = [-(-(a + c) // BLOCK_SIZE) for a, c in zip(starts, counts)]
    order = torch.randperm(sum(per_seq), generator=torch.Generator().manual_seed(seed)).tolist()
    bounds = [0, *accumulate(per_seq)]
    tables = [order[bounds[i] : bounds[i + 1]] for i in range(len(per_seq))]
    meta = eager_inputs(None, starts, counts, tables, BLOCK_SIZE, torch.device(device)).meta
    dec, pre = TritonAttentionBackend._plan(meta, torch.device(device))
    return {
        "q": torch.randn(sum(counts), heads, head_dim, generator=g, device=device, dtype=dtype),
        "kv_cache": torch.randn(2, sum(per_seq), BLOCK_SIZE, kv_heads, head_dim, generator=g,
                                device=device, dtype=dtype),
        "block_tables": meta.block_tables, "seq_lens": meta.seq_lens, "query_start_loc": meta.query_start_loc,
        "decodes": dec, "prefills": pre, "max_query_len": meta.max_query_len, "scale": head_dim**-0.5,
        "decode_count": decodes,
        "kv_bytes": decodes * context * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8,
    }


def launchers(step: dict, out: torch.Tensor, num_sms: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(decode kernel, prefill kernel) writing their rows of ``out``, as the backend calls them."""
    s = step
    splits = num_kv_splits(s["decode_count"], s["kv_cache"].shape[3], num_sms)

    def decode() -> None:
        paged_decode_attention(s["q"], s["kv_cache"], s["block_tables"], s["seq_lens"], s["query_start_loc"],
                               out, s["scale"], splits, seq_idx=s["decodes"])

    def prefill() -> None:
        paged_prefill_attention(s["q"], s["kv_cache"], s["block_tables"], s["seq_lens"], s["query_start_loc"],
                                s["prefills"], s["max_query_len"], out, s["scale"])

    return decode, prefill


def side_by_side(decode: Callable[[], None], prefill: Callable[[], None], side: torch.cuda.Stream) -> Callable[[], None]:
    """The decode kernel on ``side``, forked from and joined back to the current stream."""
    def call() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            decode()
        prefill()
        main.wait_stream(side)
    return call


def time_us(fn: Callable[[], None], iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean microseconds a call over ``iters`` calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def run_case(decodes: int, args: argparse.Namespace, copy_bw: float, num_sms: int) -> dict:
    step = make_step(decodes, args.context, args.prompts, args.prompt_len)
    out = torch.full_like(step["q"], float("nan"))
    decode, prefill = launchers(step, out, num_sms)

    def serial() -> None:
        decode()
        prefill()

    serial()
    torch.cuda.synchronize()
    ref = out.clone()
    if torch.isnan(ref).any():
        raise RuntimeError(f"{decodes} decodes: the two kernels left rows of the output unwritten")
    row = {"decodes": decodes, "decode_us": time_us(decode, args.iters), "prefill_us": time_us(prefill, args.iters),
           "serial_us": time_us(serial, args.iters), "kv_at_copy_bw_us": step["kv_bytes"] / copy_bw * 1e6}
    # Lower numbers run first; -1 is in every CUDA device's range (Hopper's is 0 to -5).
    for name, priority in (("overlap_high_us", -1), ("overlap_normal_us", 0)):
        call = side_by_side(decode, prefill, torch.cuda.Stream(priority=priority))
        out.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        row[name.replace("_us", "_exact")] = bool(torch.equal(out, ref))
        row[name] = time_us(call, args.iters)
    row["most_saved_us"] = row["serial_us"] - max(row["decode_us"], row["prefill_us"])
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decodes", nargs="+", type=int, default=[128, 256, 496])
    p.add_argument("--context", type=int, default=1100, help="tokens of each decoding sequence")
    p.add_argument("--prompts", type=int, default=15)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default="bench/results/attention_overlap.json")
    args = p.parse_args(argv)
    if min(args.decodes) < 1 or args.prompts < 1 or args.prompt_len < 2 or args.context < 1:
        p.error("--decodes, --prompts and --context want at least 1, --prompt-len at least 2")
    return args


def main() -> int:
    args = parse_args()
    copy_bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [run_case(n, args, copy_bw, sms) for n in args.decodes]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args),
                                           "copy_bandwidth": copy_bw, "rows": rows}, indent=1))
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; {args.prompts} x {args.prompt_len} new tokens beside "
          f"decodes of {args.context} tokens; us a layer")
    print("| decodes | decode alone | prefill alone | series | side by side (high / normal priority) | "
          "most overlap saves | decode KV at copy bw |")
    print("|---|---|---|---|---|---|---|")
    bad = False
    for r in rows:
        exact = r["overlap_high_exact"] and r["overlap_normal_exact"]
        bad |= not exact
        print(f"| {r['decodes']} | {r['decode_us']:.1f} | {r['prefill_us']:.1f} | {r['serial_us']:.1f} | "
              f"{r['overlap_high_us']:.1f} / {r['overlap_normal_us']:.1f}{'' if exact else ' MISMATCH'} | "
              f"{r['most_saved_us']:.1f} | {r['kv_at_copy_bw_us']:.1f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
