"""Decode latency (TPOT) on dummy-weight Qwen3 shapes: ATOM vs transformers' static cache,
beside the HBM roofline measured in the same run.

    python bench/decode_latency.py [--models qwen3-0.6b qwen3-8b] [--batch-sizes 1 32]
        [--prompt-len 512] [--output-len 256] [--profile] [--json bench/results/decode_latency.json]

TPOT = (time of the last token - time of the first) / (tokens - 1), per request, averaged.
Roofline = (weight bytes + mean KV bytes read per step) / device-to-device copy bandwidth
(read + write bytes per second of a 2 GiB copy, measured first). ``--profile`` adds a torch
profiler per-kernel breakdown of batch-1 decode steps (graph replay and eager).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_models import (  # noqa: E402
    CONFIGS,
    config_path,
    copy_bandwidth,
    hf_model,
    machine,
    randomize,
    weight_bytes_per_step,
)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def kv_bytes_per_token(cfg: dict) -> int:
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def profile_steps(engine, cfg: dict, steps: int, graphs: bool) -> dict:
    """Per-kernel CUDA time over ``steps`` batch-1 decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from atom_core.sampling_params import SamplingParams

    runner = engine.runner
    saved = runner.graphs
    if not graphs:
        runner.graphs = None
    engine.add_request(prompts(1, ARGS.prompt_len, cfg["vocab_size"], 9),
                       SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True))
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    while not engine.is_finished():
        engine.step()
    runner.graphs = saved
    rows = []
    total = 0.0
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0)
        if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows.append({"kernel": evt.key[:90], "us_per_step": t / steps, "calls_per_step": evt.count / steps})
        total += t / steps
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"mode": "graph" if graphs else "eager", "wall_ms_per_step": wall * 1e3,
            "gpu_kernel_ms_per_step": total / 1e3, "kernels": rows[:25]}


def bench_atom(name: str, results: dict) -> None:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    cfg = CONFIGS[name]
    max_len = ARGS.prompt_len + ARGS.output_len + 64
    t0 = time.perf_counter()
    engine = LLMEngine(
        str(config_path(name)), load_dummy="empty", dtype="bfloat16", device="cuda",
        enable_log_stats=False, max_model_len=max_len, max_num_seqs=max(ARGS.batch_sizes),
        cudagraph_capture_sizes=sorted(set(ARGS.batch_sizes)), enforce_eager=ARGS.enforce_eager,
    )
    randomize(engine.runner.model)
    startup = time.perf_counter() - t0
    wbytes = weight_bytes_per_step(engine.runner.model)
    results[name] = {"startup_s": startup, "weight_bytes": wbytes, "batches": {}}
    for bs in ARGS.batch_sizes:
        ps = prompts(bs, ARGS.prompt_len, cfg["vocab_size"], bs)
        engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # warm-up
        params = SamplingParams(temperature=0.0, max_tokens=ARGS.output_len, ignore_eos=True)
        outs = engine.generate(ps, params)
        tpot = sum(o["tpot"] for o in outs) / len(outs)
        kv = bs * kv_bytes_per_token(cfg) * (ARGS.prompt_len + ARGS.output_len / 2)
        roof = (wbytes + kv) / results["copy_bandwidth"]
        results[name]["batches"][bs] = {
            "atom_tpot_ms": tpot * 1e3, "roofline_ms": roof * 1e3, "fraction_of_roofline": roof / tpot,
            "kv_bytes_per_step": kv, "ttft_ms": sum(o["ttft"] for o in outs) / len(outs) * 1e3,
        }
        print(f"{name} bs={bs}: ATOM TPOT {tpot * 1e3:.3f} ms, roofline {roof * 1e3:.3f} ms", flush=True)
    if ARGS.profile:
        results[name]["profile"] = [profile_steps(engine, cfg, 32, True), profile_steps(engine, cfg, 16, False)]
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def hf_generate(model, ids: torch.Tensor, **kw):
    """transformers' generate, eager: with a static cache it otherwise torch.compiles the
    forward on first use (and on new shapes), which is not the peer this bench measures."""
    try:
        return model.generate(ids, disable_compile=True, **kw)
    except (TypeError, ValueError) as exc:
        if "disable_compile" not in str(exc):
            raise
        return model.generate(ids, **kw)


def timed_generate(model, ids: torch.Tensor, n: int, kw: dict) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf_generate(model, ids, max_new_tokens=n, min_new_tokens=n, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def bench_hf(name: str, results: dict) -> None:
    cfg = CONFIGS[name]
    try:
        model = hf_model(name)
    except Exception as exc:  # report, do not lose the ATOM numbers
        results[name]["hf_error"] = f"{type(exc).__name__}: {exc}"
        return
    for bs in ARGS.batch_sizes:
        ids = torch.tensor(prompts(bs, ARGS.prompt_len, cfg["vocab_size"], bs), device="cuda")
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  eos_token_id=None, cache_implementation="static")

        try:
            timed_generate(model, ids, 8, kw)  # warm-up
            first = min(timed_generate(model, ids, 1, kw) for _ in range(2))
            total = timed_generate(model, ids, ARGS.output_len, kw)
            tpot = (total - first) / (ARGS.output_len - 1)
            results[name]["batches"][bs]["hf_static_tpot_ms"] = tpot * 1e3
            print(f"{name} bs={bs}: transformers static-cache TPOT {tpot * 1e3:.3f} ms", flush=True)
        except Exception as exc:
            results[name]["batches"][bs]["hf_error"] = f"{type(exc).__name__}: {exc}"
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    results: dict = {"machine": machine(), "args": vars(ARGS)}
    results["copy_bandwidth"] = copy_bandwidth()
    print(f"copy bandwidth {results['copy_bandwidth'] / 1e12:.2f} TB/s", flush=True)
    for name in ARGS.models:
        bench_atom(name, results)
        Path(ARGS.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.json).write_text(json.dumps(results, indent=1))
        if not ARGS.skip_hf:
            bench_hf(name, results)
        Path(ARGS.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.json).write_text(json.dumps(results, indent=1))
    print("\n| model | batch | ATOM TPOT ms | HF static TPOT ms | roofline ms | fraction |")
    print("|---|---|---|---|---|---|")
    for name in ARGS.models:
        for bs, r in results[name]["batches"].items():
            hf = r.get("hf_static_tpot_ms")
            print(f"| {name} | {bs} | {r['atom_tpot_ms']:.3f} | {hf if hf is None else f'{hf:.3f}'} | "
                  f"{r['roofline_ms']:.3f} | {r['fraction_of_roofline']:.2f} |")
    for name in ARGS.models:
        for prof in results[name].get("profile", []):
            print(f"\n{name} batch-1 {prof['mode']}: wall {prof['wall_ms_per_step']:.3f} ms/step, "
                  f"GPU kernels {prof['gpu_kernel_ms_per_step']:.3f} ms/step")
            for k in prof["kernels"][:12]:
                print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.1f}  {k['kernel']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default="bench/results/decode_latency.json")
    ARGS = p.parse_args()
    main()
