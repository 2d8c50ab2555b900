"""Offline throughput: N random prompts through ATOM's engine vs transformers' static batching.

    python bench/throughput_offline.py [--model qwen3-8b] [--num-prompts 1024] [--input-len 1024]
        [--output-len 128] [--hf-batch-size 64] [--hf-batches 2] [--floor-seconds 4] [--profile 16]
        [--json ...]

Total tok/s = (prompt + generated tokens) / wall time of the whole run (the figure vLLM's
offline throughput benchmark prints). The run steps the engine until every prompt is done
(what ``LLMEngine.generate`` does) and splits its wall time between steps that compute
prompt tokens (prefill, decodes possibly beside it) and decode-only steps. transformers runs
fixed batches of --hf-batch-size prompts (static cache, greedy, every sequence to
--output-len); its rate is measured over --hf-batches batches (the same for every batch).
It also lists the Triton kernels compiled during the timed run (bench/compile_log.py):
the engine's warm-up is meant to leave none, and each one held every step while it built.

Beside them it prints the run's floor (``common.offline_floor``): its GEMMs at the bf16
rate this GPU sustains at its power limit (one step's tokens by the hidden size by four,
timed for --floor-seconds after the engine is gone) plus the decode tokens' KV reads at the
copy bandwidth, both measured in the same run; attention, norms and activations are not in
it. The GEMM rate is the board's steady state under GEMMs alone: in a run the lighter
kernels between them let the clock recover, and a profile can show the prefill GEMMs above
it (bench/RESULTS.md), so the floor is the reference a run is measured against, not a bound.

``--profile N`` replays the run's start afterwards (fresh prompts, same shapes) and profiles
N engine steps from --profile-start on (default: around the end of the first wave of
prefills, so the window holds prefill and decode steps): the per-kernel breakdown.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from atom_core.config import SchedulerConfig

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    MODELS,
    add_quant_args,
    config_path,
    copy_bandwidth,
    free_memory,
    hf_generate,
    hf_model,
    host_api_table,
    kernel_table,
    kv_bytes_per_token,
    kv_elem_bytes,
    load_config,
    machine,
    markdown_table,
    offline_floor,
    params_per_token,
    print_kernels,
    profiler_activities,
    quant_kwargs,
    random_prompts,
    randomize,
    sustained_gemm,
    sync,
    write_json,
)
from compile_log import CompileLog  # noqa: E402


class StepClock:
    """Steps an engine and times each step, split into steps that compute some prompt token
    (prefill) and decode-only steps. The engine does not hand out the step's batch, so the
    clock wraps this engine's ``scheduler.schedule`` to look at it (undone on exit)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.tokens = [0, 0]  # prompt, generated (counted as the engine's stats count them)
        self._kind: str | None = None
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._look

    def _look(self, *args, **kwargs):
        batch = self._schedule(*args, **kwargs)
        prefill = any(n != 1 or s.num_computed_tokens + 1 != s.num_tokens
                      for s, n in zip(batch.seqs, batch.num_scheduled_tokens))
        self._kind = None if not batch.seqs else "prefill" if prefill else "decode"
        return batch

    def step(self) -> None:
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        if self._kind is not None:
            self.steps[self._kind] += 1
            self.seconds[self._kind] += dt
        prompt, generated = self.engine.last_step_tokens
        self.tokens[0] += prompt
        self.tokens[1] += generated

    def summary(self) -> dict:
        return {kind: {"steps": self.steps[kind], "wall_s": self.seconds[kind],
                       "ms_per_step": self.seconds[kind] / self.steps[kind] * 1e3
                       if self.steps[kind] else 0.0}
                for kind in self.steps}

    def __enter__(self) -> StepClock:
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.engine.scheduler.schedule  # the class's method again


def run(engine: Any, prompts: list[list[int]], params: Any) -> tuple[float, StepClock]:
    """Every prompt to completion, step by step; (wall seconds, the clock)."""
    sync(engine.device)
    t0 = time.perf_counter()
    engine.add_request(prompts, params)
    with StepClock(engine) as clock:
        while not engine.is_finished():
            clock.step()
    sync(engine.device)
    return time.perf_counter() - t0, clock


def profile_run(engine: Any, prompts: list[list[int]], params: Any, start: int, steps: int) -> dict:
    """Per-kernel time over engine steps [start, start + steps) of a run of ``prompts``; the
    rest is aborted."""
    from torch.profiler import profile

    rids = engine.add_request(prompts, params)
    with StepClock(engine) as clock:
        for _ in range(start):
            clock.step()
        sync(engine.device)
        before = dict(clock.steps)
        with profile(activities=profiler_activities(engine.device)) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                clock.step()
            sync(engine.device)
            wall = (time.perf_counter() - t0) / steps
    for rid in rids:
        engine.abort_request(rid)
    events = prof.key_averages()
    total, rows = kernel_table(events, steps, engine.device)
    return {"start": start, "steps": steps, "wall_ms_per_step": wall * 1e3,
            "gpu_kernel_ms_per_step": total / 1e3,
            "host_api": host_api_table(events, steps),
            "prefill_steps": clock.steps["prefill"] - before["prefill"],
            "decode_steps": clock.steps["decode"] - before["decode"], "kernels": rows}


def profile_start() -> int:
    """--profile-start, or half the window before the first wave of prefills ends (when
    max_num_seqs prompts have been prefilled, max_num_batched_tokens per step)."""
    if ARGS.profile_start is not None:
        return ARGS.profile_start
    wave = min(ARGS.num_prompts, ARGS.max_num_seqs) * ARGS.input_len
    return max(0, -(-wave // ARGS.max_num_batched_tokens) - ARGS.profile // 2)


def bench_atom(results: dict) -> None:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    vocab = load_config(ARGS.model)["vocab_size"]
    t0 = time.perf_counter()
    engine = LLMEngine(
        str(config_path(ARGS.model)), load_dummy="empty", dtype="bfloat16", device="cuda",
        enable_log_stats=False, max_model_len=ARGS.input_len + ARGS.output_len + 16,
        max_num_seqs=ARGS.max_num_seqs, max_num_batched_tokens=ARGS.max_num_batched_tokens,
        async_scheduling=ARGS.async_scheduling, **quant_kwargs(ARGS),
        **({"mixed_prefill_tokens": ARGS.mixed_prefill_tokens}
           if ARGS.mixed_prefill_tokens is not None else {}),
        **({"cudagraph_capture_sizes": ARGS.cudagraph_capture_sizes}
           if ARGS.cudagraph_capture_sizes else {}),
        **({"block_size": ARGS.block_size} if ARGS.block_size else {}),
    )
    randomize(engine.runner.model)
    results["atom_startup_s"] = time.perf_counter() - t0
    cfg = load_config(ARGS.model)
    head = getattr(getattr(engine.runner.model, "lm_head", None), "weight", None)
    results["model_size"] = {
        "params_per_token": params_per_token(engine.runner.model,
                                             cfg.get("num_experts_per_tok") or 0),
        "lm_head_params": head.numel() if head is not None else 0,
        "kv_bytes_per_token": kv_bytes_per_token(cfg, kv_elem_bytes(ARGS)),
    }
    t0 = time.perf_counter()
    engine.warmup()  # as the server does before it takes requests
    results["atom_warmup_s"] = time.perf_counter() - t0
    ps = random_prompts(ARGS.num_prompts, ARGS.input_len, vocab)
    engine.generate(random_prompts(8, ARGS.input_len, vocab, 1),
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=ARGS.output_len, ignore_eos=True)
    with CompileLog() as compiles:
        wall, clock = run(engine, ps, params)
    n_in, n_out = clock.tokens
    results["atom"] = {
        "wall_s": wall, "total_tok_s": (n_in + n_out) / wall, "output_tok_s": n_out / wall,
        "num_prompts": len(ps), "kv_blocks": engine.runner.num_blocks,
        "preemptions": engine.num_preemptions, "steps": clock.summary(),
        "compiles": compiles.compiles,
    }
    print(f"ATOM: {len(ps)} prompts in {wall:.1f} s: {(n_in + n_out) / wall:,.0f} tok/s total, "
          f"{n_out / wall:,.0f} generated tok/s; during the run, {compiles.summary()}",
          flush=True)
    for c in compiles.compiles:
        ms = "?" if c["ms"] is None else f"{c['ms']:.0f}"
        print(f"  {c['kernel']} {ms} ms, {c['num_warps']} warps, {c['num_stages']} stages, "
              f"constants {c['constants']}, specialized {c['specialized']}", flush=True)
    if ARGS.profile:
        fresh = random_prompts(ARGS.num_prompts, ARGS.input_len, vocab, 2)
        results["profile"] = profile_run(engine, fresh, params, profile_start(), ARGS.profile)


@torch.inference_mode()
def bench_floor(results: dict) -> None:
    """The run's floor (common.offline_floor) at two rates measured here: a GEMM of one
    step's tokens sustained for --floor-seconds (the board settles at its power limit, as a
    long run's prefill does), in bf16, or in fp8 with --quantization fp8 (its prefill steps
    run W8A8), and the copy bandwidth."""
    hidden = load_config(ARGS.model)["hidden_size"]
    gemm = sustained_gemm(ARGS.max_num_batched_tokens, hidden, 4 * hidden, ARGS.floor_seconds,
                          fp8=ARGS.quantization == "fp8")
    size = results["model_size"]
    results["floor"] = {
        "gemm": gemm,
        **offline_floor(ARGS.num_prompts, ARGS.input_len, ARGS.output_len, size["params_per_token"],
                        size["lm_head_params"], size["kv_bytes_per_token"], gemm["tflops"] * 1e12,
                        copy_bandwidth()),
    }


@torch.inference_mode()
def bench_hf(results: dict) -> None:
    vocab = load_config(ARGS.model)["vocab_size"]
    try:
        model = hf_model(ARGS.model)
    except Exception as exc:
        results["hf_error"] = f"{type(exc).__name__}: {exc}"
        return
    results["hf_experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    bs = ARGS.hf_batch_size
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static",
              max_new_tokens=ARGS.output_len, min_new_tokens=ARGS.output_len)
    try:
        warm = torch.tensor(random_prompts(bs, ARGS.input_len, vocab, 99), device=model.device)
        hf_generate(model, warm, attention_mask=torch.ones_like(warm),
                    **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        sync(model.device)
        t0 = time.perf_counter()
        for b in range(ARGS.hf_batches):
            ids = torch.tensor(random_prompts(bs, ARGS.input_len, vocab, b), device=model.device)
            hf_generate(model, ids, attention_mask=torch.ones_like(ids), **kw)
        sync(model.device)
        wall = time.perf_counter() - t0
        tokens = ARGS.hf_batches * bs * (ARGS.input_len + ARGS.output_len)
        results["hf"] = {"batch_size": bs, "batches": ARGS.hf_batches, "wall_s": wall,
                         "total_tok_s": tokens / wall,
                         "output_tok_s": ARGS.hf_batches * bs * ARGS.output_len / wall}
        print(f"transformers static batching (bs {bs}): {tokens / wall:,.0f} tok/s total",
              flush=True)
    except Exception as exc:
        results["hf_error"] = f"{type(exc).__name__}: {exc}"
        print(f"transformers failed: {exc}", flush=True)


def report(results: dict) -> None:
    a = results["atom"]
    rows = [["ATOM", a["num_prompts"], f"{a['wall_s']:.1f}", f"{a['total_tok_s']:,.0f}",
             f"{a['output_tok_s']:,.0f}"]]
    if "hf" in results:
        h = results["hf"]
        rows.append([f"transformers (static, bs {h['batch_size']})", h["batches"] * h["batch_size"],
                     f"{h['wall_s']:.1f}", f"{h['total_tok_s']:,.0f}", f"{h['output_tok_s']:,.0f}"])
    f = results.get("floor")
    if f:
        rows.append(["floor: GEMMs + KV reads only", a["num_prompts"], f"{f['floor_s']:.1f}",
                     f"{f['floor_tok_s']:,.0f}", "-"])
    header = ["engine", "prompts", "wall s", "total tok/s", "generated tok/s"]
    print("\n" + markdown_table(header, rows))
    if f:
        print(f"\nfloor = {f['gemm_pflop']:.2f} PFLOP of GEMM at {f['gemm_tflops']:.0f} TFLOP/s "
              f"sustained ({f['gemm']['watts']:.0f} W, {f['gemm']['sm_mhz']:.0f} MHz) = "
              f"{f['gemm_s']:.1f} s, plus {f['kv_tb']:.1f} TB of decode KV reads at "
              f"{f['copy_tb_s']:.2f} TB/s = {f['kv_s']:.1f} s; "
              f"ATOM at {f['floor_s'] / a['wall_s']:.0%} of it")
    print("\nATOM's wall time by step kind:")
    for kind, s in a["steps"].items():
        print(f"  {kind:8s} {s['steps']:6d} steps  {s['wall_s']:8.2f} s "
              f"({s['wall_s'] / a['wall_s']:.0%})  {s['ms_per_step']:8.2f} ms/step")
    if "profile" in results:
        p = results["profile"]
        print(f"\nsteps {p['start']}..{p['start'] + p['steps'] - 1} "
              f"({p['prefill_steps']} with prefill, {p['decode_steps']} decode-only; "
              f"under the profiler): wall {p['wall_ms_per_step']:.2f} ms/step, "
              f"GPU kernels {p['gpu_kernel_ms_per_step']:.2f} ms/step")
        print_kernels(p["kernels"], 20)
        print("host time in the CUDA runtime (waits show the host ahead of the GPU):")
        print_kernels(p["host_api"], 8)


def main() -> None:
    results: dict = {"machine": machine(), "args": vars(ARGS)}
    bench_atom(results)  # returns with the engine gone: transformers' model never shares the GPU
    results["gpu_bytes_after_engine"] = free_memory()
    print(f"{results['gpu_bytes_after_engine'] / 2**30:.2f} GiB still allocated after the engine",
          flush=True)
    if ARGS.floor_seconds > 0:
        bench_floor(results)
    write_json(ARGS.json, results)
    if ARGS.hf_batches > 0:
        bench_hf(results)
        results["gpu_bytes_after_hf"] = free_memory()
        write_json(ARGS.json, results)
    report(results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", choices=MODELS)
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig().max_num_seqs,
                   help="default: the engine's")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=None,
                   help="KV cache tokens per block (default: the engine's)")
    p.add_argument("--mixed-prefill-tokens", type=int, default=None,
                   help="the engine's cap on prompt tokens beside decodes (default: "
                        "LLMEngine's offline default, none: each step up to "
                        "--max-num-batched-tokens; the server's is 448)")
    add_quant_args(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="run every step one ahead (the engine's default)")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--hf-batches", type=int, default=2, help="0 skips transformers")
    p.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None,
                   help="decode batch sizes captured as CUDA graphs (default: the engine's)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N engine steps (0: none)")
    p.add_argument("--profile-start", type=int, default=None,
                   help="engine steps before the profiled ones (default: see above)")
    p.add_argument("--floor-seconds", type=float, default=4.0,
                   help="how long the GEMM ceiling behind the printed floor runs (0: no floor)")
    p.add_argument("--json", default="bench/results/throughput_offline.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    main()
