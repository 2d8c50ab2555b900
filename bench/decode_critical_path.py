"""Where a graph-replayed decode step's time goes with PDL on: each kernel's share of the
critical path, not its duration.

    python bench/decode_critical_path.py [--model qwen3-30b-a3b] [--batch 32] [--steps 8]
        [--json bench/results/decode_critical_path.json]

Under programmatic dependent launch a kernel starts while the one before it drains and
waits inside, so a profiler's per-kernel durations overlap and add up to more than the
step. In a one-stream chain, what a kernel costs the step is how far it moves the end of
the chain: ``end_i - max(previous ends)``, and an idle GPU shows as a start past every
earlier end. This prints, per kernel (GEMVs and norms told apart by the kernel before
them), calls a step, critical-path us a step and a call, mean duration, and the idle time
after it; and, beside the step's TPOT from ``LLMEngine.generate``, the same graph replayed
back to back (the GPU's time for a step, with no host in between, over the last profiled
step's inputs). The profiler slows the host, so idle time it shows counts only where the
back-to-back replay is also faster than TPOT. Dummy weights drawn N(0, 0.02), 512-token
random prompts, greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpu_models import (  # noqa: E402
    MODELS,
    config_path,
    decoding,
    load_config,
    machine,
    profiler_activities,
    random_prompts,
    randomize,
    sync,
)

PROMPT_LEN = 512
# Kernels named by what they are, whatever Triton or cuBLAS called their specialisation.
KNOWN = ("_gate_up_kernel", "_down_kernel", "_gemv_kernel", "_decode_kernel", "_rms_norm_kernel",
         "_sum_pairs_kernel", "_moe_topk_kernel", "_align_small_kernel", "_split_k_reduce_kernel",
         "nvjet", "Memcpy", "Memset", "gather")
# Kernels that run more than once a layer: labelled by the kernel before them.
BY_PREDECESSOR = ("_gemv_kernel", "_rms_norm_kernel")


def kernel_name(raw: str) -> str:
    return next((k for k in KNOWN if k in raw), raw[:48])


def critical_path(events: list[dict[str, Any]], steps: int) -> tuple[list[dict[str, Any]], float]:
    """(rows per kernel label, idle us a step) from trace events with ``name``, ``ts`` and
    ``dur`` (us) of one stream's chain, any order."""
    crit: dict[str, float] = defaultdict(float)
    dur: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    idle_after: dict[str, float] = defaultdict(float)
    idle, end_max, prev = 0.0, None, None
    for e in sorted(events, key=lambda e: e["ts"]):
        start, end = e["ts"], e["ts"] + e["dur"]
        label = kernel_name(e["name"])
        if label in BY_PREDECESSOR and prev is not None:
            label = f"{label} after {prev.split(' after ')[0]}"
        if end_max is None:
            end_max = start
        if start > end_max:  # nothing ran in between
            idle += start - end_max
            if prev is not None:
                idle_after[prev] += start - end_max
        crit[label] += max(0.0, end - max(end_max, start))
        dur[label] += e["dur"]
        calls[label] += 1
        end_max = max(end_max, end)
        prev = label
    rows = [{"kernel": k, "calls_per_step": calls[k] / steps, "critical_us_per_step": crit[k] / steps,
             "critical_us_per_call": crit[k] / calls[k], "duration_us_per_call": dur[k] / calls[k],
             "idle_after_us_per_step": idle_after[k] / steps} for k in crit]
    rows.sort(key=lambda r: -r["critical_us_per_step"])
    return rows, idle / steps


def device_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / replays


def main() -> None:
    from torch.profiler import profile

    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=MODELS)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "decode_critical_path.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_critical_path.py needs a CUDA GPU")
    cfg = load_config(args.model)
    engine = LLMEngine(
        str(config_path(args.model)), load_dummy="empty", dtype="bfloat16", device="cuda", enable_log_stats=False,
        max_model_len=PROMPT_LEN + args.output_len + args.steps + 64, max_num_seqs=args.batch,
        max_num_batched_tokens=max(16384, args.batch * PROMPT_LEN), cudagraph_capture_sizes=[args.batch],
    )
    randomize(engine.runner.model)
    prompts = random_prompts(args.batch, PROMPT_LEN, cfg["vocab_size"], args.batch)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # warm-up
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
    tpot_ms = sum(o["tpot"] for o in outs) / len(outs) * 1e3
    with decoding(engine, prompts, 4 + args.steps + 8):
        for _ in range(4):
            engine.step()
        sync(engine.device)
        with profile(activities=profiler_activities(engine.device)) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            sync(engine.device)
            wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = device_events(json.loads(path.read_text()))
    rows, idle_us = critical_path(events, args.steps)
    back_to_back = replay_ms(engine.runner.graphs.graphs[args.batch])
    print(f"{args.model} batch {args.batch}: TPOT {tpot_ms:.3f} ms; the graph replayed back to back "
          f"{back_to_back:.3f} ms; under the profiler {wall_ms:.3f} ms a step, {idle_us:.1f} us of it idle")
    print(f"{'kernel':40s} {'calls':>6s} {'critical us/step':>16s} {'us/call':>8s} {'duration us/call':>16s}")
    for r in rows:
        print(f"{r['kernel']:40s} {r['calls_per_step']:6.1f} {r['critical_us_per_step']:16.1f} "
              f"{r['critical_us_per_call']:8.2f} {r['duration_us_per_call']:16.2f}")
    report = {"machine": machine(), "model": args.model, "batch": args.batch, "steps": args.steps,
              "tpot_ms": tpot_ms, "graph_back_to_back_ms": back_to_back, "profiled_wall_ms": wall_ms,
              "idle_us_per_step": idle_us, "kernels": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
