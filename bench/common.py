"""What the benches share: the models they run (their shipped configs in bench/configs/),
random prompts and weights, transformers' model of a config, the decode roofline's bytes
(the weights and the experts a step actually touches, plus KV), timing on the GPU (CUDA
events, CUDA graphs, a GEMM sustained at the board's power limit), the copy bandwidth, the
profiler's per-kernel table, markdown tables, and the JSON every bench writes, stamped
with the machine, the commit and the date.

Importable without CUDA (the CPU benches and the tests use it): only the functions that
time or allocate on the GPU touch torch.cuda.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import random
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "deepseek-v2-lite")
# Runnable by name (--models), not by default: the families served by their own plugins.
MORE_MODELS = ("gpt-oss-20b", "glm-4.5-air")


# --- the stamp, tables and JSON -------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The host (CPU, cores, Python, torch) and, where there is one, the first GPU."""
    info: dict[str, Any] = {"cpu": cpu_name(), "cpus": os.cpu_count(),
                            "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def commit() -> str:
    """The checkout's short HEAD, "+dirty" when tracked files differ from it. A copied tree
    (a device machine's) may carry no .git, or one of another commit: name the commit
    there with ``ATOM_BENCH_COMMIT``."""
    if os.environ.get("ATOM_BENCH_COMMIT"):
        return os.environ["ATOM_BENCH_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout; set ATOM_BENCH_COMMIT)"
    return head + ("+dirty" if dirty else "")


def stamp() -> dict[str, Any]:
    """What identifies a measurement: the machine, the commit and the date (UTC)."""
    return {"machine": machine(), "commit": commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """``data`` under the stamp's keys (its own "machine", if it has one, wins), to ``path``
    (bench/results/ by default in every bench: git-ignored, see bench/RESULTS.md)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**stamp(), **data}, indent=1) + "\n")
    return path


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; infinite where out holds a NaN or an infinity."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table, as bench/RESULTS.md quotes them."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# --- the models -----------------------------------------------------------------------------


def config_path(name: str) -> Path:
    return ROOT / "bench" / "configs" / name / "config.json"


def load_config(name: str) -> dict[str, Any]:
    return json.loads(config_path(name).read_text())


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


WEIGHT_SCHEMES = ("normal", "vllm")


# e8m0 2**-7: uniform e2m1 codes (RMS 2.93) then have an RMS of 0.023, about N(0, 0.02)'s.
MXFP4_SCALE = 120


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, scheme: str = "normal") -> None:
    """Random weights drawn on the device (never time on zeros or uninitialised memory).

    ``normal``: matrices N(0, 0.02), vectors (norm weights, biases) 1; MXFP4 stacks (uint8)
    uniform random codes under one e8m0 scale (``MXFP4_SCALE``), whatever the scheme.
    ``vllm``: what vLLM's dummy loader draws (vLLM's published figures were taken on dummy
    weights): every floating parameter uniform in [-1e-3, 1e-3] from a generator seeded 1234
    afresh for each parameter, so a parameter's values depend only on its size. A MoE step's
    time follows the experts its tokens touch (the bench prints them per layer), so the
    scheme could change the workload; on the benchmarked MoE models both route near-uniformly under
    ATOM's fp32 router. vLLM's DeepSeek router scores in bf16, where these weights tie every
    score: ``tie_routers`` gives that workload."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"weight scheme {scheme!r}: expected one of {WEIGHT_SCHEMES}")
    torch.manual_seed(seed)
    named = dict(model.named_parameters())
    for name, p in named.items():
        if p.dtype == torch.float8_e4m3fn:  # --quantization fp8: draw, then quantize
            _randomize_fp8(p, named[f"{name}_scale"], scheme)
        elif name.endswith("_scale") and named.get(name[:-6], p).dtype == torch.float8_e4m3fn:
            continue  # set with its weight
        elif p.dtype == torch.uint8:  # MXFP4 experts: e2m1 code pairs and e8m0 scales
            if name.endswith("_scale"):
                p.fill_(MXFP4_SCALE)
            else:
                p.random_(0, 256)
        elif scheme == "vllm":
            if p.is_floating_point():
                gen = torch.Generator(device=p.device).manual_seed(1234)
                p.uniform_(-1e-3, 1e-3, generator=gen)
        elif p.dim() >= 2:
            p.normal_(0.0, 0.02)
        else:
            p.fill_(1.0)


def _randomize_fp8(qweight: torch.Tensor, scale: torch.Tensor, scheme: str) -> None:
    """An fp8 weight and its per-row scales from a matrix drawn as ``randomize`` draws one,
    quantized as ``--quantization fp8`` quantizes (one expert at a time for a stack)."""
    from atom_core.quant.fp8 import quantize_rows

    for q, s in zip(qweight.view(-1, *qweight.shape[-2:]), scale.view(-1, scale.shape[-1])):
        w = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        if scheme == "vllm":
            w.uniform_(-1e-3, 1e-3, generator=torch.Generator(device=q.device).manual_seed(1234))
        else:
            w.normal_(0.0, 0.02)
        values, scales = quantize_rows(w)
        q.copy_(values)
        s.copy_(scales)


ROUTINGS = ("drawn", "tied")


@torch.no_grad()
def tie_routers(model: torch.nn.Module) -> int:
    """Zero every MoE router's weight (and score-correction bias), ATOM's ``TopKRouter`` and
    transformers' ``mlp.gate`` alike: every logit is then 0, every expert's score ties, and
    every token picks the same experts (the lowest ids, or whatever top-k's tie order gives).
    That is the workload of vLLM's dummy-weight DeepSeek runs, whose bf16 softmax rounds
    every score to 1/E (bench/RESULTS.md, "Settled questions"). Returns the routers zeroed;
    raises for a model with none."""
    tied = 0
    for name, p in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
            p.zero_()
            tied += name.endswith(".weight")
    if not tied:
        raise ValueError(f"{type(model).__name__} has no MoE router to tie")
    return tied


def hf_model(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
             weights: str = "normal") -> Any:
    """transformers' model of the shipped config (Qwen3ForCausalLM, Qwen3MoeForCausalLM,
    DeepseekV2ForCausalLM: all in transformers itself, no remote code), random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        **{k: v for k, v in load_config(name).items() if k != "architectures"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    randomize(model, scheme=weights)
    return model.eval()


def hf_generate(model: Any, ids: torch.Tensor, **kw: Any) -> Any:
    """transformers' generate, eager: with a static cache it otherwise torch.compiles the
    forward on first use (and on new shapes), which is not the peer these benches measure."""
    try:
        return model.generate(ids, disable_compile=True, **kw)
    except (TypeError, ValueError) as exc:
        if "disable_compile" not in str(exc):
            raise
        return model.generate(ids, **kw)


# --- what a decode step reads ---------------------------------------------------------------


def add_quant_args(p: argparse.ArgumentParser) -> None:
    """The engine's FP8 flags, as a bench passes them on (``quant_kwargs``)."""
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: weights quantized online at load (the engine's flag)")
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--fp8-w8a8-min-rows", type=int, default=None,
                   help="the engine's crossover to W8A8 (default: the engine's)")
    p.add_argument("--fp8-layers", nargs="+", default=None,
                   help="the layer kinds quantized (default: the engine's)")


def quant_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLMEngine keyword arguments for ``add_quant_args``'s flags."""
    kw: dict[str, Any] = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.quantization:
        kw["quantization"] = args.quantization
        if args.fp8_w8a8_min_rows is not None:
            kw["fp8_w8a8_min_rows"] = args.fp8_w8a8_min_rows
        if args.fp8_layers:
            kw["fp8_layers"] = args.fp8_layers
    return kw


def kv_elem_bytes(args: argparse.Namespace) -> int:
    return 1 if args.kv_cache_dtype == "fp8" else 2


def kv_bytes_per_token(cfg: dict[str, Any], elem: int = 2) -> int:
    """KV-cache bytes one token occupies: MLA (DeepSeek) caches one latent plus the shared
    RoPE key per layer; GQA caches a key and a value per KV head."""
    layers = cfg["num_hidden_layers"]
    if cfg.get("kv_lora_rank"):
        return layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return layers * 2 * cfg["num_key_value_heads"] * head_dim * elem


def moe_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every stack of experts of the model, by module name: a module that holds
    ``w13_weight`` and ``w2_weight`` stacks (experts first) and is called with
    ``(x, topk_weights, topk_ids)``, as the core's FusedMoE and gpt-oss's experts are."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "w13_weight", None), torch.Tensor)
            and isinstance(getattr(m, "w2_weight", None), torch.Tensor)}


def expert_slots(moe: torch.nn.Module) -> tuple[int, int]:
    """(routed, shared) experts stacked in a FusedMoE. Where the layer folds shared experts
    in (``num_shared_experts``), they are the last slots and every token uses them."""
    shared = int(getattr(moe, "num_shared_experts", 0) or 0)
    return moe.w13_weight.shape[0] - shared, shared


def expert_bytes(moe: torch.nn.Module) -> int:
    """Bytes of one expert's weights: its slice of w13 and of w2, and of their scales where
    they are quantized (fp8 rows, MXFP4 groups)."""
    names = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    stacks = [w for w in (getattr(moe, n, None) for n in names) if isinstance(w, torch.Tensor)]
    return sum(w[0].numel() * w.element_size() for w in stacks)


def shared_experts(cfg: dict[str, Any]) -> int:
    """Shared experts per MoE layer, as the config counts them (Qwen3-MoE has none)."""
    return int(cfg.get("n_shared_experts") or 0)


def is_moe(cfg: dict[str, Any]) -> bool:
    return any(k in cfg for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def uniform_experts_touched(cfg: dict[str, Any], batch: int) -> float:
    """Distinct routed experts ``batch`` tokens touch if each picks top-k uniformly at
    random: E * (1 - (1 - k/E)^batch). Beside the measured count, it shows routing skew."""
    # DeepSeek's name, Qwen3-MoE's, and the one transformers 5 writes for Qwen3-MoE.
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"]
    k = cfg["num_experts_per_tok"]
    return experts * (1 - (1 - k / experts) ** batch)


def _stacked_embed_head(model: torch.nn.Module) -> tuple[set[int], Any, Any]:
    """(ids of the stacked expert weights and of their fp8 scales, the input embedding's
    weight, the LM head's)."""
    stacked = {id(w) for m in moe_layers(model).values() for w in (m.w13_weight, m.w2_weight)}
    stacked |= {id(p) for n, p in model.named_parameters()
                if n.endswith(("w13_weight_scale", "w2_weight_scale"))}
    embed = next((m.weight for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    return stacked, embed, head


def step_bytes(model: torch.nn.Module, batch: int, experts_touched: dict[str, float]) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads: every parameter once,
    except an untied input embedding (``batch`` rows of it) and the stacked experts, of
    which only the touched ones: ``experts_touched[layer]`` routed experts (a mean over
    steps) plus every shared slot. A dense model passes ``{}``."""
    stacked, embed, head = _stacked_embed_head(model)
    total = 0.0
    for p in model.parameters():
        if id(p) in stacked:
            continue
        if p is embed and head is not embed:
            total += batch * p[0].numel() * p.element_size()
        else:
            total += p.numel() * p.element_size()
    for name, moe in moe_layers(model).items():
        total += (experts_touched[name] + expert_slots(moe)[1]) * expert_bytes(moe)
    return total


def params_per_token(model: torch.nn.Module, top_k: int = 0) -> int:
    """Weights one token's forward multiplies by (two FLOPs each): every matrix but the
    input embedding, the LM head (applied to sampled rows only) and the stacked experts, of
    which a token uses its ``top_k`` routed experts and every shared slot."""
    stacked, embed, head = _stacked_embed_head(model)
    total = sum(p.numel() for p in model.parameters()
                if p.dim() == 2 and id(p) not in stacked and p is not embed and p is not head)
    for moe in moe_layers(model).values():
        per_expert = moe.w13_weight[0].numel() + moe.w2_weight[0].numel()
        total += (top_k + expert_slots(moe)[1]) * per_expert
    return total


def offline_floor(prompts: int, input_len: int, output_len: int, params: int, head_params: int,
                  kv_per_token: int, gemm_flops: float, copy_bw: float) -> dict[str, float]:
    """The wall time of an offline run of ``prompts`` x (input_len in / output_len out) that
    did only two things, each at a given rate: its GEMMs (2 FLOPs per weight for every token
    forwarded, the LM head for every sampled one) at ``gemm_flops`` per second, and the
    decode tokens' KV reads (each decode token reads its whole context) at ``copy_bw`` bytes
    per second. Attention arithmetic, norms and activations are left out."""
    # The first output token comes from prefill.
    forwarded = prompts * (input_len + output_len - 1)
    flop = 2.0 * forwarded * params + 2.0 * prompts * output_len * head_params
    # Decode token t sees input_len + t tokens.
    contexts = sum(input_len + t for t in range(1, output_len))
    kv = float(prompts * contexts * kv_per_token)
    gemm_s, kv_s = flop / gemm_flops, kv / copy_bw
    return {"gemm_pflop": flop / 1e15, "kv_tb": kv / 1e12, "gemm_tflops": gemm_flops / 1e12,
            "copy_tb_s": copy_bw / 1e12, "gemm_s": gemm_s, "kv_s": kv_s, "floor_s": gemm_s + kv_s,
            "floor_tok_s": prompts * (input_len + output_len) / (gemm_s + kv_s)}


class ExpertCounter:
    """Forward hooks on every FusedMoE that record, per call, how many distinct routed
    experts the step's tokens chose (``topk_ids``; shared slots excluded, step_bytes adds
    them). Hooks do not fire under CUDA-graph replay: count eager steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = moe_layers(model)
        self.counts: dict[str, list[int]] = {name: [] for name in layers}
        self._handles = [
            m.register_forward_hook(partial(self._record, name), with_kwargs=True)
            for name, m in layers.items()
        ]

    def _record(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                output: Any) -> None:
        ids = kwargs["topk_ids"] if "topk_ids" in kwargs else args[2]
        routed, _ = expert_slots(module)
        self.counts[name].append(ids[ids < routed].unique().numel())

    def means(self) -> dict[str, float]:
        return {name: sum(c) / len(c) for name, c in self.counts.items() if c}

    def __enter__(self) -> ExpertCounter:
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()


@contextmanager
def decoding(engine: Any, prompts: list[list[int]], max_tokens: int) -> Iterator[list[str]]:
    """Queue ``prompts`` (greedy, ignore_eos) and step until every one has its first token,
    so the next steps are pure decode of ``len(prompts)`` sequences; on exit abort what is
    left, so the engine is empty again. Yields the request ids."""
    from atom_core.sampling_params import SamplingParams

    started: set[str] = set()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = engine.add_request(prompts, params,
                              stream_callback=lambda out: started.add(out.request_id))
    try:
        while len(started) < len(rids):
            engine.step()
        yield rids
    finally:
        for rid in rids:
            engine.abort_request(rid)


def touched_experts(engine: Any, prompts: list[list[int]], steps: int = 8) -> dict[str, float]:
    """Mean distinct routed experts per MoE layer over ``steps`` eager decode steps of
    ``len(prompts)`` sequences ({} for a dense model). CUDA graphs are set aside meanwhile,
    as hooks do not fire under replay."""
    runner = engine.runner
    if not moe_layers(runner.model):
        return {}
    saved, runner.graphs = runner.graphs, None
    try:
        with decoding(engine, prompts, steps + 8), ExpertCounter(runner.model) as counter:
            for _ in range(steps):
                engine.step()
    finally:
        runner.graphs = saved
    return counter.means()


# --- timing on the GPU ----------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> int:
    """Collect garbage and return cached blocks; the bytes still allocated on the GPU (0 on
    a machine without one), so a run shows the previous engine or model is gone."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def event_seconds(fn: Callable[[], Any], reps: int = 10, warmup: int = 3) -> float:
    """Seconds of one call of ``fn``: the median of ``reps`` CUDA-event timings after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of 20)."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    seconds = event_seconds(copy, reps=20)
    del src, dst, copy
    torch.cuda.empty_cache()
    return 2 * (1 << 30) * 2 / seconds


def graph_us(fns: list[Callable[[], Any]], replays: int = 7) -> float:
    """Microseconds per call of ``fns`` run back to back in one CUDA graph (median replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:  # compile and warm outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    seconds = event_seconds(graph.replay, reps=replays, warmup=0)
    del graph
    return seconds * 1e6 / len(fns)


def sweep(
    make_calls: Callable[..., list[Callable[[], Any]]], space: list[tuple], out: torch.Tensor,
    describe: Callable[[tuple], dict],
) -> dict:
    """``graph_us(make_calls(*point))`` for every point of ``space``, the first being what
    the op picks today; each row also holds the largest difference of ``out`` from the
    first point's result. {"default": first row, "best": fastest row, "all": rows}."""
    for fn in make_calls(*space[0]):
        fn()
    ref = out.float().clone()
    rows = []
    for point in space:
        us = graph_us(make_calls(*point), replays=20)
        diff = (out.float() - ref).abs().max().item()
        rows.append({**describe(point), "us": us, "max_abs_diff": diff})
    return {"default": rows[0], "best": min(rows, key=lambda r: r["us"]), "all": rows}


def run_shapes(names: list[str], measure: Callable[[str], dict], json_path: str) -> None:
    """``measure(name)`` for each shape (its tensors freed before the next), the results to
    ``json_path`` by name."""
    results = {}
    for name in names:
        results[name] = measure(name)
        torch.cuda.empty_cache()
    write_json(json_path, {"shapes": results})


def shape_args(doc: str, json_path: str, shapes: list[str], choice: str,
               kv_dtype: bool = False, splits: list[int] | None = None,
               fused_input: bool = False, block_size: int | None = None,
               tma: bool = False) -> argparse.Namespace:
    """The kernel benches' command line: --json (default ``json_path``), --default-only (time
    only the op's own split count and ``choice``), --shapes (of ``shapes``, all by default);
    with ``kv_dtype``, --kv-dtype (bf16 or fp8, the cache's) and --f16; with ``splits``,
    --splits (the split counts swept, all of ``splits`` by default); with ``fused_input``,
    --fused-input (decode attention's q/k norm, RoPE and cache write in the kernel); with
    ``block_size``, --block-size (the cache's tokens a page, that by default); with ``tma``,
    --tma (the K/V tiles by pointer or by TMA, instead of the op's rule)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--json", default=json_path)
    p.add_argument("--default-only", action="store_true",
                   help=f"time only today's split count and {choice}")
    p.add_argument("--shapes", nargs="+", choices=shapes, default=shapes)
    if kv_dtype:
        p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
        p.add_argument("--f16", type=int, choices=(0, 1), default=None,
                       help="force the kernel's fp16 compute of an fp8 cache off or on")
    if splits:
        p.add_argument("--splits", type=int, nargs="+", choices=splits, default=splits)
    if fused_input:
        p.add_argument("--fused-input", action="store_true",
                       help="the model's fused attention input (new_tokens)")
    if block_size:
        p.add_argument("--block-size", type=int, default=block_size,
                       help="the cache's tokens per page (--block-size of the engine)")
    if tma:
        p.add_argument("--tma", type=int, choices=(0, 1), default=None,
                       help="force the K/V tiles' loads by pointer (0) or TMA (1)")
    return p.parse_args()


def parse_power_samples(lines: list[str]) -> list[tuple[float, float]]:
    """(watts, SM MHz) from ``nvidia-smi --query-gpu=power.draw,clocks.sm
    --format=csv,noheader,nounits`` lines; lines it cannot read (a "[N/A]") are skipped."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            out.append((float(parts[0]), float(parts[1])))
        except (IndexError, ValueError):
            continue
    return out


class PowerLog:
    """``nvidia-smi`` sampling power and SM clock every 100 ms while the block runs; no
    samples (NaN power and clock in the results) where there is no ``nvidia-smi``."""

    def __enter__(self) -> PowerLog:
        self.samples: list[tuple[float, float]] = []
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=power.draw,clocks.sm",
                 "--format=csv,noheader,nounits", "-lms", "100",
                 "-i", str(torch.cuda.current_device())],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self._proc = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate(timeout=10)
            self.samples = parse_power_samples(out.splitlines())


def sustained_gemm(m: int, k: int, n: int, seconds: float, fp8: bool = False) -> dict:
    """An [m, k] x [k, n] bf16 GEMM (``F.linear``, cuBLAS) back to back for ``seconds``: its
    rate, and the board's mean power and SM clock once the first second has settled. Over
    seconds an H200 settles at its power limit and clocks down, which a short timing (a few
    calls at the boost clock) does not show. ``fp8``: the e4m3 GEMM with a scale per row
    and per column (``torch._scaled_mm``, bf16 out), as W8A8 steps run."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    fn = functools.partial(torch.nn.functional.linear, x, w)
    if fp8:
        xq, wq = x.to(torch.float8_e4m3fn), w.mul(16).to(torch.float8_e4m3fn)
        sa = torch.ones(m, 1, device="cuda")
        sb = torch.ones(1, n, device="cuda")
        fn = functools.partial(torch._scaled_mm, xq, wq.t(), scale_a=sa, scale_b=sb,
                               out_dtype=torch.bfloat16)
    with PowerLog() as log:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    steady = log.samples[10:] or log.samples  # 100 ms samples
    watts = sum(s[0] for s in steady) / len(steady) if steady else float("nan")
    mhz = sum(s[1] for s in steady) / len(steady) if steady else float("nan")
    return {"m": m, "k": k, "n": n, "calls": calls, "wall_s": wall,
            "fp8": fp8, "tflops": 2 * m * k * n * calls / wall / 1e12, "watts": watts,
            "sm_mhz": mhz,
            "samples": len(log.samples)}


# --- the profiler ---------------------------------------------------------------------------


def profiler_activities(device: torch.device) -> list[Any]:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def kernel_table(events: Any, steps: int, device: torch.device,
                 top: int = 25) -> tuple[float, list[dict]]:
    """(device microseconds per step, the ``top`` kernels by time) from a profiler's
    ``key_averages()``: each kernel's self time and calls per step. On a CPU-only run the
    CPU ops stand in for kernels."""
    cuda = device.type == "cuda"
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    rows = []
    for evt in events:
        if cuda:
            t = getattr(evt, "self_device_time_total", None)
            t = getattr(evt, "self_cuda_time_total", 0) if t is None else t
        else:
            t = evt.self_cpu_time_total
        # A record_function range (the runner's step labels) spans kernels: not one itself.
        if t <= 0 or evt.device_type != kind or getattr(evt, "is_user_annotation", False):
            continue
        rows.append({"kernel": evt.key[:90], "us_per_step": t / steps,
                     "calls_per_step": evt.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return sum(r["us_per_step"] for r in rows), rows[:top]


def host_api_table(events: Any, steps: int, top: int = 12) -> list[dict]:
    """The host's time per step in CUDA runtime and driver calls (``cuda*`` / ``cu*``),
    from a profiler's ``key_averages()``, in the rows ``kernel_table`` gives. A host ahead
    of the GPU spends its spare time in a synchronize; a host that is the bottleneck spends
    almost none there."""
    rows = [{"kernel": evt.key[:90], "us_per_step": evt.self_cpu_time_total / steps,
             "calls_per_step": evt.count / steps}
            for evt in events
            if evt.device_type == torch.autograd.DeviceType.CPU and evt.key.startswith("cu")
            and evt.self_cpu_time_total > 0]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def print_kernels(rows: list[dict], top: int = 12) -> None:
    for k in rows[:top]:
        print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.1f}  {k['kernel']}")
