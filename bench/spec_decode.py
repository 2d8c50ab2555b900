"""Speculative decoding's TPOT on dummy-weight models at forced acceptance lengths: ATOM with
a draft network beside the same model without one, transformers' plain decode, and the
limit a verifying step could reach.

    python bench/spec_decode.py [--setups deepseek-v2-lite+mtp qwen3-8b+eagle3]
        [--k 1 3] [--lengths 1.0 2.0 4.0] [--batch-sizes 1 8 32] [--prompt-len 512]
        [--output-len 128] [--hf-output-len 32] [--no-hf] [--profile [missed|all|off]]
        [--json bench/results/spec_decode.json]

Setups: ``deepseek-v2-lite+mtp`` (DeepSeek-V2-Lite's shape with one multi-token-prediction
layer, ``num_nextn_predict_layers: 1`` added to its config, ``--method mtp``),
``qwen3-8b+eagle3`` (Qwen3-8B and an EAGLE-3 head in the published layout, one layer of the
target's shape, a 32,000-token draft vocabulary, ``--method eagle3``) and, asked for by
name, ``qwen3-8b+qwen3-0.6b`` (``--method draft_model``). Every weight, the draft's
included, is dummy (``--load_dummy xavier``), bf16. A setup whose method is not registered
is reported as skipped.

Each setup runs one plain engine (no ``--method``, the engine's defaults: CUDA-graph decode,
async scheduling) and one speculative engine per k; ``Speculator.force_acceptance`` switches
the forced mean acceptance length (the target's own token included) between runs: by
default 1.0 (no draft accepted), 2.0 and k + 1. At every batch size the prompts (random
tokens) are prefilled in one step, a 16-token warm-up runs, then a timed greedy run of
``--output-len`` tokens (ignore_eos). TPOT = (time of the last token - time of the first) /
(tokens - 1), per request, averaged: per output token, however many a step emits. Ratio =
speculative TPOT / plain TPOT at the same batch. Tokens per forward come from the
speculator's counts over the timed run (they should be about the forced length: a little
under it, as the last steps of a request may draft fewer).

Limit = the plain decode roofline at that batch (the weight bytes a step reads, for MoE only
the experts its tokens touch, counted over 8 eager steps as in decode_latency.py, plus the
mean KV bytes, over the device-to-device copy bandwidth measured first) / the forced
length: a verifying step that cost one plain decode step, with a free draft. Peer:
transformers' static-cache plain decode TPOT of the same target at batch 1 (transformers
has no forced acceptance; its assisted generation would accept nothing of random drafts).

Targets, at batch 1: k = 3 and length 4.0 at most 0.40x the plain TPOT; length 1.0 (every
k run) at most 1.25x. ``--profile`` (``missed``, the default: the target rows that miss;
``all``: every target row; ``off``) adds torch-profiler tables over 16 engine steps of the
row and of a plain batch-1 decode step: wall and kernel time per step, the step's
record_function ranges (the engine labels a whole step: the verifying forward, sampling
and the draft network are one range), every kernel, and the kernels' time over a plain
step's, kernel by kernel (what the draft and the wider verify cost).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    config_path,
    copy_bandwidth,
    decoding,
    event_seconds,
    free_memory,
    hf_model,
    kernel_table,
    kv_bytes_per_token,
    load_config,
    machine,
    markdown_table,
    print_kernels,
    profiler_activities,
    random_prompts,
    step_bytes,
    sync,
    touched_experts,
    write_json,
)
from decode_latency import timed_generate, token_budget  # noqa: E402

EAGLE3_DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' draft vocabulary
MAX_GRAPH_ROWS = 256  # the engine's largest default decode graph
WARMUP_TOKENS = 16
PROFILE_WARMUP = 4  # engine steps between the prefill and the profiled ones
PROFILE_STEPS = 16


# --- the setups -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """A target from bench/configs and how it drafts: ``draft`` "eagle3" derives an EAGLE-3
    head from the target's config; another name is a bench/configs model
    (``--method draft_model``)."""

    target: str
    method: str
    draft: str | None = None
    mtp_layers: int = 0


SETUPS = {
    "deepseek-v2-lite+mtp": Setup("deepseek-v2-lite", "mtp", mtp_layers=1),
    "qwen3-8b+eagle3": Setup("qwen3-8b", "eagle3", draft="eagle3"),
    "qwen3-8b+qwen3-0.6b": Setup("qwen3-8b", "draft_model", draft="qwen3-0.6b"),
}
DEFAULT_SETUPS = ["deepseek-v2-lite+mtp", "qwen3-8b+eagle3"]


@dataclass(frozen=True)
class Models:
    """What the engines load: the target's config.json, the method and its draft directory."""

    target: Path
    method: str
    draft: Path | None = None


def with_mtp_layers(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """The target's config with ``layers`` multi-token-prediction modules declared."""
    return {**cfg, "num_nextn_predict_layers": layers}


def rope_theta(cfg: dict[str, Any]) -> float:
    """The RoPE base, as a published config writes it or as transformers 5 saves it."""
    return cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]


def eagle3_draft_config(target: dict[str, Any]) -> dict[str, Any]:
    """An EAGLE-3 head's config.json for ``target``, in the published layout (e.g.
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): one Llama layer of the target's shape, the
    target's vocabulary, a smaller draft vocabulary of its own."""
    vocab = target["vocab_size"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim")
        or target["hidden_size"] // target["num_attention_heads"],
        "intermediate_size": target["intermediate_size"],
        "hidden_act": target.get("hidden_act", "silu"),
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": rope_theta(target),
        "max_position_embeddings": target["max_position_embeddings"],
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": min(EAGLE3_DRAFT_VOCAB, vocab),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_config(directory: Path, cfg: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    return path


def prepare(setup: Setup, tmp: Path) -> Models:
    """The files ``setup`` needs, written under ``tmp`` where they are not shipped."""
    target = config_path(setup.target)
    cfg = load_config(setup.target)
    if setup.mtp_layers:
        target = write_config(tmp / "target", with_mtp_layers(cfg, setup.mtp_layers))
    draft = None
    if setup.draft == "eagle3":
        draft = write_config(tmp / "eagle3", eagle3_draft_config(cfg)).parent
    elif setup.draft is not None:
        draft = config_path(setup.draft).parent
    return Models(target, setup.method, draft)


def unregistered(method: str) -> str | None:
    """Why ``method`` cannot run here, or None."""
    from atom_core.plugins import get_registries

    methods = get_registries().proposers
    if method in methods:
        return None
    return (f"--method {method} is not registered (registered: "
            f"{', '.join(methods.names()) or 'none'})")


# --- what is run and judged -----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A row's ratio to meet: spec TPOT / plain TPOT <= ``max_ratio`` at ``length`` and
    ``batch`` (and ``k``, or every k where None)."""

    label: str
    max_ratio: float
    length: float
    batch: int = 1
    k: int | None = None

    def matches(self, row: dict[str, Any]) -> bool:
        return (row["length"] == self.length and row["batch"] == self.batch
                and self.k in (None, row["k"]))


TARGETS = (
    Target("k=3, length 4.0, batch 1: <= 0.40x plain", 0.40, 4.0, 1, 3),
    Target("length 1.0, batch 1: <= 1.25x plain (a cheap draft)", 1.25, 1.0, 1),
)


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target against every row it covers (rows without a ratio are left out)."""
    out = []
    for target in TARGETS:
        for row in rows:
            if target.matches(row) and row.get("ratio") is not None:
                out.append({"target": target.label, "k": row["k"], "length": row["length"],
                            "batch": row["batch"], "ratio": row["ratio"],
                            "max_ratio": target.max_ratio,
                            "met": row["ratio"] <= target.max_ratio})
    return out


def lengths_for(k: int, given: list[float] | None) -> list[float]:
    """Forced lengths to run at ``k``: ``given`` within [1, k + 1], or 1.0, 2.0 and k + 1."""
    wanted = given if given else [1.0, 2.0, float(k + 1)]
    return sorted({float(x) for x in wanted if 1.0 <= x <= k + 1})


def capture_sizes(batches: list[int], k: int) -> list[int]:
    """Decode graph sizes: each batch, and its rows with k drafts each, up to 256."""
    sizes = {b * rows for b in batches for rows in (1, k + 1)}
    return sorted(s for s in sizes if s <= MAX_GRAPH_ROWS)


def profile_tokens(k: int) -> int:
    """Tokens a profiled request may emit without finishing before its steps end."""
    return (PROFILE_WARMUP + PROFILE_STEPS) * (k + 1) + 8


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The speculator's counts between two ``SpecDecodeStats.as_dict()`` snapshots."""
    drafted = after["total_draft_tokens"] - before["total_draft_tokens"]
    accepted = after["total_accepted_tokens"] - before["total_accepted_tokens"]
    forwards = after["num_verifications"] - before["num_verifications"]
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "verifications": forwards,
            "tokens_per_forward": 1.0 + accepted / forwards if forwards else None,
            "acceptance_rate": accepted / drafted if drafted else None}


# --- the engines ----------------------------------------------------------------------------


def engine_kwargs(args: argparse.Namespace, device: torch.device, k: int) -> dict[str, Any]:
    batches = args.batch_sizes
    return dict(
        load_dummy="xavier", dtype="bfloat16" if device.type == "cuda" else "float32",
        device=device.type, enable_log_stats=False,
        max_model_len=args.prompt_len + max(args.output_len, profile_tokens(k)) + 64,
        max_num_seqs=max(batches), max_num_batched_tokens=token_budget(max(batches),
                                                                         args.prompt_len),
        cudagraph_capture_sizes=capture_sizes(batches, k),
    )


def timed_run(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """A warm-up, then the timed greedy run: mean TPOT and TTFT, and the speculator's
    counts over the timed run."""
    from atom_core.sampling_params import SamplingParams

    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS,
                                            ignore_eos=True))
    spec = engine.speculator
    before = spec.stats.as_dict() if spec is not None else None
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                   ignore_eos=True))
    out = {"tpot_ms": sum(o["tpot"] for o in outs) / len(outs) * 1e3,
           "ttft_ms": sum(o["ttft"] for o in outs) / len(outs) * 1e3,
           "tokens": sum(o["num_tokens_output"] for o in outs)}
    if spec is not None:
        out.update(stats_delta(before, spec.stats.as_dict()))
    return out


def range_table(events: Any, steps: int) -> list[dict[str, Any]]:
    """The record_function ranges of a profile (host side): calls, host time and the device
    time of the kernels launched inside, per step."""
    rows = [{"range": evt.key[:90], "calls_per_step": evt.count / steps,
             "host_us_per_step": evt.cpu_time_total / steps,
             "device_us_per_step": getattr(evt, "device_time_total", 0) / steps}
            for evt in events
            if getattr(evt, "is_user_annotation", False)
            and evt.device_type == torch.autograd.DeviceType.CPU]
    rows.sort(key=lambda r: -r["host_us_per_step"])
    return rows


def kernel_delta(rows: list[dict[str, Any]], plain: list[dict[str, Any]],
                 top: int = 15) -> list[dict[str, Any]]:
    """Kernels by their time per step over a plain step's (``kernel_table`` rows), largest
    first: where a speculative step's extra time goes."""
    base = {r["kernel"]: r for r in plain}
    out = []
    for r in rows:
        p = base.get(r["kernel"], {"us_per_step": 0.0, "calls_per_step": 0.0})
        out.append({"kernel": r["kernel"], "us_per_step": r["us_per_step"] - p["us_per_step"],
                    "calls_per_step": r["calls_per_step"] - p["calls_per_step"]})
    out.sort(key=lambda r: -r["us_per_step"])
    return out[:top]


def profile_steps(engine: Any, batch: int, prompt_len: int, k: int) -> dict[str, Any]:
    """Torch-profiler tables over PROFILE_STEPS engine steps of ``batch`` decoding
    sequences (``k``: the engine's drafts per step, 0 for the plain engine)."""
    from torch.profiler import profile

    prompts = random_prompts(batch, prompt_len, engine.hf_config.vocab_size, 9)
    spec = engine.speculator
    with decoding(engine, prompts, profile_tokens(k)):
        for _ in range(PROFILE_WARMUP):
            engine.step()
        sync(engine.device)
        before = spec.stats.as_dict() if spec is not None else None
        with profile(activities=profiler_activities(engine.device)) as prof:
            t0 = time.perf_counter()
            for _ in range(PROFILE_STEPS):
                engine.step()
            sync(engine.device)
            wall = (time.perf_counter() - t0) / PROFILE_STEPS
        counts = stats_delta(before, spec.stats.as_dict()) if spec is not None else {}
    events = prof.key_averages()
    total, kernels = kernel_table(events, PROFILE_STEPS, engine.device, top=1 << 30)
    return {"k": k, "batch": batch, "length": spec.forced_length if spec is not None else None,
            "mode": "graph" if engine.runner.graphs is not None else "eager",
            "wall_ms_per_step": wall * 1e3, "gpu_kernel_ms_per_step": total / 1e3,
            "tokens_per_forward": counts.get("tokens_per_forward") or 1.0,
            "ranges": range_table(events, PROFILE_STEPS), "kernels": kernels,
            "phases_ms": phase_split(engine, batch, k)}


def phase_split(engine: Any, batch: int, k: int) -> dict[str, float] | None:
    """GPU time of a speculative step's graphed parts, each replayed alone over the rows
    the last step left in its static buffers (cache writes switched off: slot -1): the
    target over the verify rows (and over one row per sequence, a plain decode step), the
    draft network over the verify rows (its first step) and over one row per sequence
    (each of the k - 1 others). None without graphs."""
    from atom_core.engine.input_batch import SLOTS

    runner, spec = engine.runner, engine.speculator
    drafter = spec.drafter if spec is not None else None
    if runner.graphs is None or not k:
        return None
    parts = [("verify forward", runner.graphs, batch * (k + 1)),
             ("plain decode forward", runner.graphs, batch)]
    if drafter is not None and drafter.graphs is not None:
        first = batch * (k + 1 + (0 if drafter.network.reads_target_hidden else 1))
        parts += [("draft first step", drafter.graphs, first),
                  ("draft next step", drafter.graphs, batch)]
    out = {}
    for name, graphs, rows in parts:
        padded = graphs.padded_size(rows)
        if padded is None:
            continue
        graphs.inputs.dev[SLOTS].fill_(-1)
        out[name] = event_seconds(lambda g=graphs, p=padded: g.replay(p)) * 1e3
    return out


def bench_plain(models: Models, cfg: dict[str, Any], args: argparse.Namespace,
                device: torch.device, copy_bw: float) -> dict[str, Any]:
    """The target without speculation: TPOT and the decode roofline per batch size."""
    from atom_core.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(models.target), **engine_kwargs(args, device, 0))
    model = engine.runner.model
    out: dict[str, Any] = {"batches": {}}
    for bs in args.batch_sizes:
        prompts = random_prompts(bs, args.prompt_len, cfg["vocab_size"], bs)
        run = timed_run(engine, prompts, args.output_len)
        touched = touched_experts(engine, prompts)
        wbytes = step_bytes(model, bs, touched)
        kv = bs * kv_bytes_per_token(cfg) * (args.prompt_len + args.output_len / 2)
        roof_ms = (wbytes + kv) / copy_bw * 1e3
        out["batches"][bs] = {**run, "roofline_ms": roof_ms, "weight_bytes_per_step": wbytes,
                              "kv_bytes_per_step": kv}
        print(f"  plain bs={bs}: TPOT {run['tpot_ms']:.3f} ms, roofline {roof_ms:.3f} ms "
              f"({wbytes / 1e9:.2f} GB weights a step)", flush=True)
    if args.profile != "off" and 1 in args.batch_sizes:
        out["profile"] = profile_steps(engine, 1, args.prompt_len, 0)
    return out


def bench_spec(models: Models, k: int, cfg: dict[str, Any], args: argparse.Namespace,
               device: torch.device, plain: dict[str, Any]) -> dict[str, Any]:
    """One speculative engine at ``k``: a row per forced length and batch size, and the
    profiles ``--profile`` asks for."""
    from atom_core.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(models.target), method=models.method, num_speculative_tokens=k,
                       draft_model=str(models.draft) if models.draft else None,
                       **engine_kwargs(args, device, k))
    rows: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    for length in lengths_for(k, args.lengths):
        engine.speculator.force_acceptance(length)
        for bs in args.batch_sizes:
            prompts = random_prompts(bs, args.prompt_len, cfg["vocab_size"], bs)
            run = timed_run(engine, prompts, args.output_len)
            base = plain["batches"][bs]
            row = {"k": k, "length": length, "batch": bs, **run,
                   "plain_tpot_ms": base["tpot_ms"], "ratio": run["tpot_ms"] / base["tpot_ms"],
                   "plain_roofline_ms": base["roofline_ms"],
                   "limit_ms": base["roofline_ms"] / length}
            rows.append(row)
            tpf = run["tokens_per_forward"]
            print(f"  k={k} length {length:.2f} bs={bs}: TPOT {run['tpot_ms']:.3f} ms "
                  f"({row['ratio']:.2f}x plain), tokens/forward "
                  f"{'-' if tpf is None else f'{tpf:.2f}'}, limit {row['limit_ms']:.3f} ms",
                  flush=True)
            judged = verdicts([row])
            if judged and (args.profile == "all"
                           or (args.profile == "missed" and not all(v["met"] for v in judged))):
                prof = profile_steps(engine, bs, args.prompt_len, k)
                # The step's time unprofiled: what the phase split is set against.
                prof["step_ms"] = run["tpot_ms"] * (run["tokens_per_forward"] or 1.0)
                profiles.append(prof)
    return {"rows": rows, "profiles": profiles}


def bench_models(models: Models, args: argparse.Namespace, device: torch.device,
                 copy_bw: float) -> dict[str, Any]:
    """A plain engine, then a speculative one per k (each freed before the next): the
    setup's rows, target verdicts and profiles."""
    result: dict[str, Any] = {"target": str(models.target), "method": models.method,
                              "draft": str(models.draft) if models.draft else None}
    reason = unregistered(models.method)
    if reason is not None:
        print(f"  skipped: {reason}", flush=True)
        return {**result, "skipped": reason}
    cfg = json.loads(models.target.read_text())
    try:
        result["plain"] = bench_plain(models, cfg, args, device, copy_bw)
    except Exception as exc:  # report, keep the other setups
        result["plain_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    # Outside the handler: a traceback would keep the engine's frames (and memory) alive.
    free_memory()
    if "plain" not in result:
        return result
    result["rows"], result["profiles"], result["errors"] = [], [], {}
    for k in args.k:
        try:
            spec = bench_spec(models, k, cfg, args, device, result["plain"])
            result["rows"] += spec["rows"]
            result["profiles"] += spec["profiles"]
        except Exception as exc:
            result["errors"][k] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        result[f"gpu_bytes_after_k{k}"] = free_memory()
    result["verdicts"] = verdicts(result["rows"])
    return result


@torch.inference_mode()
def bench_hf(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """transformers' static-cache plain decode of bench/configs ``name`` at batch 1."""
    cfg = load_config(name)
    n = args.hf_output_len
    try:
        model = hf_model(name)
        ids = torch.tensor(random_prompts(1, args.prompt_len, cfg["vocab_size"], 1),
                           device=model.device)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  eos_token_id=None, cache_implementation="static")
        timed_generate(model, ids, 8, kw)  # warm-up
        first = min(timed_generate(model, ids, 1, kw) for _ in range(2))
        total = timed_generate(model, ids, n, kw)
    except Exception as exc:  # report, do not lose the engine's numbers
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
    tpot_ms = (total - first) / (n - 1) * 1e3
    print(f"  transformers {name} bs=1: static-cache TPOT {tpot_ms:.3f} ms (over {n} tokens)",
          flush=True)
    return {"tpot_ms": tpot_ms, "tokens_timed": n}


# --- the report -----------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def setup_table(result: dict[str, Any]) -> str:
    """The setup's rows beside transformers' plain TPOT (batch 1) and the limit."""
    hf = (result.get("hf") or {}).get("tpot_ms")
    rows = []
    for r in result.get("rows", []):
        tpf = r.get("tokens_per_forward")
        rows.append([r["k"], f"{r['length']:.2f}", r["batch"], ms(r["plain_tpot_ms"]),
                     ms(r["tpot_ms"]), f"{r['ratio']:.2f}",
                     "-" if tpf is None else f"{tpf:.2f}", ms(hf) if r["batch"] == 1 else "-",
                     f"{ms(r['plain_roofline_ms'])} / {ms(r['limit_ms'])}"])
    header = ["k", "length", "batch", "ATOM plain TPOT ms", "ATOM spec TPOT ms", "ratio",
              "tokens/forward", "HF plain TPOT ms", "limit ms (plain / spec)"]
    return markdown_table(header, rows)


def verdict_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    judged = result.get("verdicts", [])
    for target in TARGETS:
        mine = [v for v in judged if v["target"] == target.label]
        if not mine:
            lines.append(f"target {target.label}: not measured")
        for v in mine:
            lines.append(f"target {target.label}: k={v['k']} ratio {v['ratio']:.2f} "
                         f"{'MET' if v['met'] else 'MISSED'}")
    return lines


def print_profile(prof: dict[str, Any], plain: dict[str, Any] | None) -> None:
    label = "plain" if not prof["k"] else f"k={prof['k']} length {prof['length']:.2f}"
    print(f"\n{label} batch {prof['batch']} ({prof['mode']}): wall "
          f"{prof['wall_ms_per_step']:.3f} ms/step, GPU kernels "
          f"{prof['gpu_kernel_ms_per_step']:.3f} ms/step, "
          f"{prof['tokens_per_forward']:.2f} tokens/forward")
    for r in prof["ranges"][:6]:
        print(f"  range {r['range']}: x{r['calls_per_step']:.1f}, host "
              f"{r['host_us_per_step']:.1f} us, device {r['device_us_per_step']:.1f} us")
    phases = prof.get("phases_ms")
    if phases:
        gpu = phases.get("verify forward", 0.0) + phases.get("draft first step", 0.0) + (
            prof["k"] - 1) * phases.get("draft next step", 0.0)
        print("  GPU time of the graphed parts, each replayed alone: " + ", ".join(
            f"{name} {ms:.3f} ms" for name, ms in phases.items()))
        step = prof.get("step_ms", prof["wall_ms_per_step"])
        print(f"  verify + draft steps {gpu:.3f} ms of a {step:.3f} ms step (unprofiled); the "
              f"rest (sampling, verification, host gaps) {step - gpu:.3f} ms")
    print_kernels(prof["kernels"])
    if plain is not None and prof["k"]:
        print("  over a plain step:")
        print_kernels(kernel_delta(prof["kernels"], plain["kernels"]), top=10)


def report(results: dict[str, Any]) -> None:
    for name, result in results["setups"].items():
        print(f"\n## {name}\n")
        if "skipped" in result:
            print(f"skipped: {result['skipped']}")
            continue
        if "plain_error" in result:
            print(f"plain engine failed: {result['plain_error']}")
            continue
        print(setup_table(result))
        for k, err in result.get("errors", {}).items():
            print(f"k={k} failed: {err}")
        print("\n" + "\n".join(verdict_lines(result)))
        plain = result["plain"].get("profile")
        for prof in ([plain] if plain else []) + result.get("profiles", []):
            print_profile(prof, plain)


def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    results: dict[str, Any] = {"machine": machine(), "args": vars(args), "setups": {}}
    results["copy_bandwidth"] = copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    peers: dict[str, dict[str, Any]] = {}
    for name in args.setups:
        setup = SETUPS[name]
        print(f"{name}:", flush=True)
        with tempfile.TemporaryDirectory(prefix="spec-decode-") as tmp:
            result = bench_models(prepare(setup, Path(tmp)), args, device, copy_bw)
        results["setups"][name] = result
        write_json(args.json, results)
        if not args.no_hf and "rows" in result:
            if setup.target not in peers:
                peers[setup.target] = bench_hf(setup.target, args)
                free_memory()
            result["hf"] = peers[setup.target]
            write_json(args.json, results)
    report(results)
    print(f"\nwrote {args.json}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", nargs="+", default=DEFAULT_SETUPS, choices=list(SETUPS))
    p.add_argument("--k", nargs="+", type=int, default=[1, 3],
                   help="drafts per step; one engine each")
    p.add_argument("--lengths", nargs="+", type=float, default=None,
                   help="forced acceptance lengths, those in [1, k+1] at each k "
                        "(default: 1.0, 2.0 and k+1)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-output-len", type=int, default=32,
                   help="tokens transformers generates in its timed run")
    p.add_argument("--no-hf", action="store_true", help="leave transformers out")
    p.add_argument("--profile", nargs="?", const="all", default="missed",
                   choices=("missed", "all", "off"),
                   help="profile the target rows that miss (default), all of them (the bare "
                        "flag) or none")
    p.add_argument("--json", default="bench/results/spec_decode.json")
    args = p.parse_args(argv)
    if min(args.k) < 1:
        p.error("--k: at least one draft per step")
    if args.output_len < 2 or args.hf_output_len < 2:
        p.error("--output-len and --hf-output-len must be at least 2 (TPOT needs a second "
                "token)")
    if min(args.batch_sizes) < 1 or args.prompt_len < 1:
        p.error("--batch-sizes and --prompt-len must be positive")
    return args


if __name__ == "__main__":
    main(parse_args())
