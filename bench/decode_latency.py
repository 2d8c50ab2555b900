"""Decode latency (TPOT) on dummy-weight models (Qwen3 dense and MoE, DeepSeek-V2-Lite): ATOM
vs transformers' static cache, beside the HBM roofline measured in the same run.

    python bench/decode_latency.py [--models qwen3-8b qwen3-30b-a3b] [--batch-sizes 1 16 32]
        [--prompt-len 512] [--output-len 256] [--hf-output-len 64] [--profile]
        [--profile-batch-sizes 1 32] [--gemv-config N,K,M=BN,BK,SPLIT ...]
        [--moe-config H,I,T=BM,BN,BK,WARPS,STAGES[,PERSISTENT[,OVERLAP]] ...]
        [--weights normal|vllm] [--routing drawn|tied] [--num-layers N]
        [--json bench/results/decode_latency.json]

TPOT = (time of the last token - time of the first) / (tokens - 1), per request, averaged.
Every batch's prompts are prefilled in one step (the engine's token budget is raised to
batch x prompt length, up to 131,072, where the default 16,384 is smaller), so TPOT is the
steady decode step: with the prompts in several chunked-prefill steps, the first requests'
TPOT would also count the later prompts' prefills.
Roofline = (weight bytes a step reads + mean KV bytes read per step) / device-to-device copy
bandwidth (read + write bytes per second of a 2 GiB copy, measured first). A MoE step reads
only the experts its tokens chose: after the timed run, 8 eager decode steps at the same
batch size count the distinct experts per layer (forward hooks), and the roofline counts
those plus every shared expert ("experts/layer"). ``--profile`` adds a torch profiler
per-kernel breakdown of decode steps (graph replay and eager) at each profiled batch size.
Under programmatic dependent launch a replayed kernel starts while the one before it runs
and its time includes that wait, so the graph rows can sum past the step; the eager rows,
whose kernels run apart, are each kernel's own time.
``--gemv-config`` runs with entries of the skinny GEMM's table replaced: a config's effect in
the model, which its kernel timed alone can hide (the one-row GEMVs' weight loads overlap the
kernel before them; the table's ``in_model`` entries). ``--moe-config`` does the same for the
fused-MoE table (Qwen3-30B-A3B's decode entries were chosen that way). ``--routing tied``
zeroes the MoE routers of both engines' models (common.tie_routers), so every token picks
the same experts: the workload behind vLLM's dummy-weight DeepSeek figures, where a bf16
softmax ties every score (bench/RESULTS.md, "Settled questions").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from atom_core.config import SchedulerConfig

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    MODELS,
    MORE_MODELS,
    ROUTINGS,
    WEIGHT_SCHEMES,
    add_quant_args,
    config_path,
    copy_bandwidth,
    decoding,
    free_memory,
    hf_generate,
    hf_model,
    is_moe,
    kernel_table,
    kv_bytes_per_token,
    kv_elem_bytes,
    load_config,
    machine,
    markdown_table,
    print_kernels,
    profiler_activities,
    quant_kwargs,
    random_prompts,
    randomize,
    shared_experts,
    step_bytes,
    sync,
    tie_routers,
    touched_experts,
    uniform_experts_touched,
    write_json,
)

PROFILE_WARMUP = 4  # decode steps between the prefill and the profiled ones


def parse_gemv_override(spec: str) -> tuple[tuple[int, int, int], dict[str, int] | None]:
    """``N,K,M=BN,BK,SPLIT[,WARPS,STAGES]`` (or ``N,K,M=cublas``) -> ((N, K, M bucket), config
    or None): one entry of the device's GEMV table to run with instead of the shipped one."""
    try:
        shape, value = spec.split("=")
        n, k, m = (int(v) for v in shape.split(","))
        if value.strip() == "cublas":
            return (n, k, m), None
        nums = [int(v) for v in value.split(",")]
        if len(nums) not in (3, 5):
            raise ValueError
    except ValueError:
        raise ValueError(f"--gemv-config {spec!r}: expected N,K,M=BN,BK,SPLIT[,WARPS,STAGES] "
                         "or N,K,M=cublas") from None
    if m & (m - 1) or not 1 <= m <= 32:  # 32: gemv_config.WIDE_ROWS, the 32-row tiles
        raise ValueError(f"--gemv-config {spec!r}: M must be a row bucket (1, 2, 4, 8, 16, 32)")
    bn, bk, split, warps, stages = nums + ([4, 2 if m == 1 else 3] if len(nums) == 3 else [])
    return (n, k, m), {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
                       "num_stages": stages}


def parse_moe_override(spec: str) -> tuple[tuple[int, int, int], dict[str, int]]:
    """``H,I,T=BM,BN,BK,WARPS,STAGES[,PERSISTENT[,OVERLAP]]`` -> ((hidden, inter, token
    bucket), config): one entry of the device's fused-MoE table to run with instead of the
    shipped one."""
    try:
        shape, value = spec.split("=")
        h, i, t = (int(v) for v in shape.split(","))
        values = [int(v) for v in value.split(",")]
        if len(values) not in (5, 6, 7):
            raise ValueError
    except ValueError:
        form = "H,I,T=BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,PERSISTENT[,OVERLAP]]"
        raise ValueError(f"--moe-config {spec!r}: expected {form}") from None
    if t < 1 or t & (t - 1):
        raise ValueError(f"--moe-config {spec!r}: T must be a token bucket (a power of two)")
    keys = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "PERSISTENT", "OVERLAP"]
    config = dict(zip(keys, values))
    if "OVERLAP" in config:
        config["OVERLAP"] = bool(config["OVERLAP"])
    return (h, i, t), config


def apply_overrides(table: dict, parse: Callable[[str], tuple[tuple[int, int, int], Any]],
                    specs: list[str]) -> dict[str, Any]:
    """Replace entries of a shape -> {bucket: config} table (the device's GEMV table with
    ``parse_gemv_override``, its fused-MoE table with ``parse_moe_override``: the objects the
    kernels read, atom_kernels_triton.tuning) in this process, before an engine is built, to
    A/B a config in the model; returns them for the results JSON."""
    applied = {}
    for spec in specs:
        (a, b, bucket), config = parse(spec)
        table.setdefault((a, b), {})[bucket] = config
        applied[f"{a},{b},{bucket}"] = config
    return applied


def profile_steps(engine, batch: int, prompt_len: int, steps: int, graphs: bool) -> dict:
    """Per-kernel device time over ``steps`` decode steps of ``batch`` sequences, from CUDA
    graphs or (``graphs=False``) eagerly."""
    from torch.profiler import profile

    runner = engine.runner
    saved = runner.graphs
    if not graphs:
        runner.graphs = None
    mode = "graph" if runner.graphs is not None else "eager"
    prompts = random_prompts(batch, prompt_len, engine.hf_config.vocab_size, 9)
    try:
        with decoding(engine, prompts, PROFILE_WARMUP + steps + 8):
            for _ in range(PROFILE_WARMUP):
                engine.step()
            sync(engine.device)
            with profile(activities=profiler_activities(engine.device)) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                sync(engine.device)
                wall = (time.perf_counter() - t0) / steps
    finally:
        runner.graphs = saved
    total, rows = kernel_table(prof.key_averages(), steps, engine.device)
    return {"batch": batch, "mode": mode, "wall_ms_per_step": wall * 1e3,
            "gpu_kernel_ms_per_step": total / 1e3, "kernels": rows}


# A prefill step's activations grow with its tokens (Qwen3-30B-A3B's fp32 per-pair buffer
# alone is 64 KiB a token): past this, a batch's prompts take more than one step again.
MAX_TOKEN_BUDGET = 131072


def token_budget(batch: int, prompt_len: int) -> int:
    """The engine's max_num_batched_tokens: its default, or room for every prompt of the
    largest batch in one prefill step, up to MAX_TOKEN_BUDGET (see the module docstring)."""
    default = SchedulerConfig().max_num_batched_tokens
    return max(default, min(batch * prompt_len, MAX_TOKEN_BUDGET))


def experts_per_layer(touched: dict[str, float], cfg: dict) -> float | None:
    """Mean experts a step reads per MoE layer: the routed ones touched plus the shared."""
    if not touched:
        return None
    return sum(touched.values()) / len(touched) + shared_experts(cfg)


def bench_atom(name: str, results: dict) -> None:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    cfg, path = model_config(name)
    sizes = sorted(set(ARGS.batch_sizes) | set(profile_sizes()))
    # Room for the timed run and for the profiled and expert-counting decodes.
    max_len = ARGS.prompt_len + max(ARGS.output_len, 64) + 64
    t0 = time.perf_counter()
    engine = LLMEngine(
        str(path), load_dummy="empty", dtype="bfloat16", device="cuda",
        enable_log_stats=False, max_model_len=max_len, max_num_seqs=max(sizes),
        max_num_batched_tokens=token_budget(max(sizes), ARGS.prompt_len),
        cudagraph_capture_sizes=sizes, enforce_eager=ARGS.enforce_eager,
        async_scheduling=ARGS.async_scheduling, **quant_kwargs(ARGS),
    )
    randomize(engine.runner.model, scheme=ARGS.weights)
    if ARGS.routing == "tied" and is_moe(cfg):
        tie_routers(engine.runner.model)
    model = engine.runner.model
    results[name] = {"startup_s": time.perf_counter() - t0, "kv_blocks": engine.runner.num_blocks,
                     "layers": cfg["num_hidden_layers"], "batches": {}}
    for bs in ARGS.batch_sizes:
        ps = random_prompts(bs, ARGS.prompt_len, cfg["vocab_size"], bs)
        warm_up = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        engine.generate(ps, warm_up)
        params = SamplingParams(temperature=0.0, max_tokens=ARGS.output_len, ignore_eos=True)
        outs = engine.generate(ps, params)
        tpot = sum(o["tpot"] for o in outs) / len(outs)
        touched = touched_experts(engine, ps, ARGS.expert_steps)
        wbytes = step_bytes(model, bs, touched)
        kv_token = kv_bytes_per_token(cfg, kv_elem_bytes(ARGS))
        kv = bs * kv_token * (ARGS.prompt_len + ARGS.output_len / 2)
        roof = (wbytes + kv) / results["copy_bandwidth"]
        per_layer = experts_per_layer(touched, cfg)
        results[name]["batches"][bs] = {
            "atom_tpot_ms": tpot * 1e3, "roofline_ms": roof * 1e3,
            "fraction_of_roofline": roof / tpot,
            "weight_bytes_per_step": wbytes, "kv_bytes_per_step": kv,
            "ttft_ms": sum(o["ttft"] for o in outs) / len(outs) * 1e3,
            "experts_per_layer": per_layer, "routed_experts_touched": touched,
            "routed_experts_touched_if_uniform":
                uniform_experts_touched(cfg, bs) if touched else None,
        }
        experts = f", {per_layer:.1f} experts/layer" if per_layer is not None else ""
        print(f"{name} bs={bs}: ATOM TPOT {tpot * 1e3:.3f} ms, roofline {roof * 1e3:.3f} ms "
              f"({wbytes / 1e9:.2f} GB weights{experts})", flush=True)
    if ARGS.profile:
        results[name]["profile"] = []
        profiles = results[name]["profile"]
        for bs in profile_sizes():
            if engine.runner.graphs is not None:
                profiles.append(profile_steps(engine, bs, ARGS.prompt_len, 32, True))
            profiles.append(profile_steps(engine, bs, ARGS.prompt_len, 16, False))


def model_config(name: str) -> tuple[dict, Path]:
    """The config of ``name`` and the path the engine loads it from: with --num-layers, a
    copy cut to its first N decoder layers (per-layer lists cut with it), in a temporary
    directory."""
    cfg = load_config(name)
    if not ARGS.num_layers or ARGS.num_layers >= cfg["num_hidden_layers"]:
        return cfg, config_path(name)
    full = cfg["num_hidden_layers"]
    cfg = {k: v[: ARGS.num_layers] if isinstance(v, list) and len(v) == full else v
           for k, v in cfg.items()}
    cfg["num_hidden_layers"] = ARGS.num_layers
    path = Path(tempfile.mkdtemp(prefix=f"{name}-{ARGS.num_layers}-layers-")) / "config.json"
    path.write_text(json.dumps(cfg))
    return cfg, path


def timed_generate(model, ids: torch.Tensor, n: int, kw: dict) -> float:
    sync(ids.device)
    t0 = time.perf_counter()
    hf_generate(model, ids, max_new_tokens=n, min_new_tokens=n, **kw)
    sync(ids.device)
    return time.perf_counter() - t0


@torch.inference_mode()
def bench_hf(name: str, results: dict) -> None:
    cfg = load_config(name)
    n = ARGS.hf_output_len
    try:
        model = hf_model(name, weights=ARGS.weights)
        if ARGS.routing == "tied" and is_moe(cfg):
            tie_routers(model)
    except Exception as exc:  # report, do not lose the ATOM numbers
        results[name]["hf_error"] = f"{type(exc).__name__}: {exc}"
        return
    results[name]["hf_experts_implementation"] = getattr(
        model.config, "_experts_implementation", None)
    for bs in ARGS.batch_sizes:
        ids = torch.tensor(random_prompts(bs, ARGS.prompt_len, cfg["vocab_size"], bs),
                           device=model.device)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  eos_token_id=None, cache_implementation="static")
        try:
            timed_generate(model, ids, 8, kw)  # warm-up
            first = min(timed_generate(model, ids, 1, kw) for _ in range(2))
            total = timed_generate(model, ids, n, kw)
            tpot = (total - first) / (n - 1)
            results[name]["batches"][bs].update(hf_static_tpot_ms=tpot * 1e3, hf_tokens_timed=n)
            print(f"{name} bs={bs}: transformers static-cache TPOT {tpot * 1e3:.3f} ms "
                  f"(over {n} tokens)", flush=True)
        except Exception as exc:
            results[name]["batches"][bs]["hf_error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name} bs={bs}: transformers failed: {exc}", flush=True)


def profile_sizes() -> list[int]:
    if not ARGS.profile:
        return []
    if ARGS.profile_batch_sizes:
        return sorted(set(ARGS.profile_batch_sizes))
    return sorted({min(ARGS.batch_sizes), max(ARGS.batch_sizes)})


def save(results: dict) -> None:
    write_json(ARGS.json, results)


def report(results: dict) -> None:
    rows = []
    for name in ARGS.models:
        if "atom_error" in results[name]:
            rows.append([name, "-", f"failed: {results[name]['atom_error'][:80]}", "", "", "", ""])
        layers = results[name].get("layers")
        shown = name if layers == load_config(name)["num_hidden_layers"] or layers is None else (
            f"{name} ({layers} of {load_config(name)['num_hidden_layers']} layers)")
        for bs, r in results[name].get("batches", {}).items():
            hf = r.get("hf_static_tpot_ms")
            hf = "-" if hf is None else f"{hf:.3f} ({r['hf_tokens_timed']})"
            ex = r["experts_per_layer"]
            ex = "-" if ex is None else f"{ex:.1f}"
            rows.append([shown, bs, f"{r['atom_tpot_ms']:.3f}", hf, ex, f"{r['roofline_ms']:.3f}",
                         f"{r['fraction_of_roofline']:.2f}"])
    header = ["model", "batch", "ATOM TPOT ms", "HF static TPOT ms (tokens)", "experts/layer",
              "roofline ms", "fraction"]
    print("\n" + markdown_table(header, rows))
    for name in ARGS.models:
        for prof in results[name].get("profile", []):
            print(f"\n{name} batch-{prof['batch']} {prof['mode']}: "
                  f"wall {prof['wall_ms_per_step']:.3f} ms/step, "
                  f"GPU kernels {prof['gpu_kernel_ms_per_step']:.3f} ms/step")
            if prof["gpu_kernel_ms_per_step"] > prof["wall_ms_per_step"]:
                print("(kernels overlap under PDL, each timed with its wait on the one before: "
                      "the eager rows give each kernel's own time)")
            print_kernels(prof["kernels"])


def main() -> None:
    from atom_kernels_triton import fused_moe_config, gemv_config, tuning

    results: dict = {"machine": machine(), "args": vars(ARGS)}
    results["gemv_overrides"] = apply_overrides(
        gemv_config.tuned(tuning.device_name()), parse_gemv_override, ARGS.gemv_config)
    results["moe_overrides"] = apply_overrides(
        fused_moe_config.tuned(tuning.device_name()), parse_moe_override, ARGS.moe_config)
    results["copy_bandwidth"] = copy_bandwidth()
    print(f"copy bandwidth {results['copy_bandwidth'] / 1e12:.2f} TB/s; weights {ARGS.weights}, "
          f"MoE routing {ARGS.routing}", flush=True)
    for name in ARGS.models:
        try:
            bench_atom(name, results)  # the engine is gone before transformers' model is built
        except Exception as exc:  # keep the other models' numbers
            results.setdefault(name, {})["atom_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        # Outside the handler: its traceback would keep the engine's frames (and GPU memory) alive.
        results[name]["gpu_bytes_after_engine"] = free_memory()
        print(f"{name}: {results[name]['gpu_bytes_after_engine'] / 2**30:.2f} GiB still allocated "
              "after the engine", flush=True)
        save(results)
        if not ARGS.skip_hf and "atom_error" not in results[name]:
            bench_hf(name, results)
            results[name]["gpu_bytes_after_hf"] = free_memory()
            save(results)
    report(results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + MORE_MODELS)
    # 16 as well: the kernels switch paths between 1 and 32 rows (the skinny GEMM serves up
    # to 16), which batches 1 and 32 alone would not show.
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-output-len", type=int, default=64,
                   help="tokens transformers generates in its timed run (eager MoE is slow)")
    p.add_argument("--expert-steps", type=int, default=8,
                   help="eager decode steps over which MoE experts touched are counted")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-layers", type=int, default=None, metavar="N",
                   help="ATOM runs each model's first N decoder layers (one too large for the "
                        "GPU: GLM-4.5-Air's 212 GB in bf16); needs --skip-hf")
    add_quant_args(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="run every step one ahead (the engine's default)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-batch-sizes", nargs="+", type=int, default=None,
                   help="batch sizes to profile "
                        "(default: the smallest and largest of --batch-sizes)")
    p.add_argument("--gemv-config", action="append", default=[], metavar="N,K,M=BN,BK,SPLIT",
                   help="replace an entry of the device's GEMV table (also N,K,M=cublas); "
                        "repeatable")
    p.add_argument("--moe-config", action="append", default=[],
                   metavar="H,I,T=BM,BN,BK,WARPS,STAGES[,PERSISTENT[,OVERLAP]]",
                   help="replace an entry of the device's fused-MoE table (hidden, inter, "
                        "token bucket); repeatable")
    p.add_argument("--weights", choices=WEIGHT_SCHEMES, default="normal",
                   help="dummy weights: N(0, 0.02) matrices, or vLLM's dummy loader's "
                        "(common.randomize)")
    p.add_argument("--routing", choices=ROUTINGS, default="drawn",
                   help="MoE routers as drawn, or tied: zeroed, every token picks the same experts "
                        "(common.tie_routers); dense models ignore it")
    p.add_argument("--json", default="bench/results/decode_latency.json")
    args = p.parse_args(argv)
    if args.hf_output_len < 2:
        p.error("--hf-output-len must be at least 2 (TPOT needs a second token)")
    if args.num_layers is not None and (args.num_layers < 1 or not args.skip_hf):
        p.error("--num-layers takes N >= 1, and --skip-hf (transformers builds whole models)")
    for spec, parse in [(s, parse_gemv_override) for s in args.gemv_config] + [
            (s, parse_moe_override) for s in args.moe_config]:
        try:
            parse(spec)
        except ValueError as exc:
            p.error(str(exc))
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    main()
