"""Serving under load: ``atom serve`` on a dummy-weight Qwen3-8B driven by ``atom bench serve``
at three concurrencies, beside vLLM 0.26's figures on the same H200, with where each
request's time to first token went.

    python bench/serving_gpu.py [--config bench/configs/qwen3-8b/config.json]
        [--levels 1:24,16:160,64:384] [--input-len 512] [--output-len 128]
        [--max-model-len 2048] [--dummy xavier] [--device auto]
        [--server-arg=--max-num-batched-tokens=4096 ...] [--warmups 2] [--engine-requests 8]
        [--vllm] [--workdir DIR] [--result-dir bench/results/serving_gpu]
        [--json bench/results/serving_gpu.json]

The model: a directory of --config with its vocabulary set to the 49,152 tokens of the
embedded SmolLM2 GGUF's tokenizer, saved beside it, so the same directory serves with dummy
weights in ATOM (``--model DIR --load_dummy=xavier``) and in vLLM (``vllm serve DIR
--load-format dummy``; both draw random weights, so tokens vary and decode to text), and the
client draws its random prompts from that tokenizer.

Each level ``CONCURRENCY:PROMPTS`` runs the client of ``atom bench serve`` (its own code,
called in this process; the equivalent command line is printed) with ``--backend vllm
--dataset-name random --ignore-eos --max-concurrency C --num-prompts P``, after --warmups
requests sent once before the first level. Around each level the server's /metrics is
scraped; the change of each phase histogram's sum over the change of its count is the mean
time of that phase over the level's requests: frontend (HTTP request to queued to the
engine), queue, prefill, first-token delivery (engine's host to the HTTP response), and the
first decode step. Their sum against the client's mean TTFT leaves the client's and the
connection's share. A server without these histograms (vLLM) gets "n/a". The CPU time the
server's process (the frontend) and the processes below it (the engine) used over each
level is read from their CPU-time clocks: a frontend near one core's share is the
bottleneck of the level.

Server overhead: after the server is gone, ``LLMEngine`` in this process on the same
directory and flags runs --engine-requests random prompts one after another (greedy,
ignore_eos); the client's mean TPOT at concurrency 1 over the engine's is what serving adds.

The prefill floor is one prompt's GEMMs (two FLOPs per weight a token multiplies by, times
--input-len) at 790 TFLOP/s, the bf16 GEMM rate measured on the H200. ``--vllm`` runs the
same levels against ``vllm serve`` where vLLM is installed. The client's full results
(every request) are saved under --result-dir; the JSON keeps their totals and means.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from atom_core.config import LOAD_DUMMY_MODES
from atom_core.entrypoints.server_process import (
    ServerProcess,
    cpu_seconds,
    descendant_pids,
    free_port,
)

sys.path.insert(0, str(Path(__file__).parent))
from common import ROOT, markdown_table, params_per_token, random_prompts, write_json  # noqa: E402

H200_BF16_FLOPS = 790e12
REF_LABEL = "vLLM 0.26 (reference, same H200, vllm bench serve)"
REF_SHAPE = (512, 128)  # input and output tokens the reference figures were taken at
# (concurrency, prompts) -> metric -> the reference's values, and the targets.
REFERENCE: dict[tuple[int, int], dict[str, tuple[float, ...]]] = {
    (1, 24): {"ttft_median_p99": (27.4, 55), "tpot": (4.99,)},
    (16, 160): {"throughput": (18.02,), "ttft_mean": (165,)},
    (64, 384): {"throughput": (45.1,), "ttft_median_p99": (252, 773), "tpot": (8.81,)},
}
Bound = tuple[str, float] | None
TARGETS: dict[tuple[int, int], dict[str, tuple[Bound, ...]]] = {
    (1, 24): {"ttft_median_p99": (("<=", 25), ("<=", 60)), "tpot": (("<=", 4.33),)},
    (64, 384): {"throughput": ((">=", 47),), "ttft_median_p99": (None, ("<=", 700)),
                "tpot": (("<=", 8.5),)},
}
# Metric -> (label, the client result's keys).
METRICS = {
    "throughput": ("request throughput req/s", ("request_throughput",)),
    "ttft_median_p99": ("median / P99 TTFT ms", ("median_ttft_ms", "p99_ttft_ms")),
    "ttft_mean": ("mean TTFT ms", ("mean_ttft_ms",)),
    "tpot": ("mean TPOT ms", ("mean_tpot_ms",)),
}
# Phase -> the server's histogram (seconds).
PHASES = {
    "frontend": "atom:request_frontend_time_seconds",
    "queue": "atom:request_queue_time_seconds",
    "prefill": "atom:request_prefill_time_seconds",
    "first_token_delivery": "atom:request_first_token_delivery_seconds",
    "first_decode": "atom:request_first_decode_time_seconds",
    "decode": "atom:request_decode_time_seconds",
    "engine_ttft": "atom:time_to_first_token_seconds",
}
TTFT_PARTS = ("frontend", "queue", "prefill", "first_token_delivery")


# ----------------------------------------------------------------------------- model dir


def make_model_dir(config: Path, dest: Path, tokenizer: Path | None = None) -> Path:
    """``dest`` holding ``config`` with the embedded GGUF's tokenizer, or the one saved in
    the directory ``tokenizer`` (its vocabulary and special-token ids written into the
    config)."""
    from transformers import AutoTokenizer

    from atom_core.loader import embedded_model_path, load_gguf_tokenizer

    tok = (AutoTokenizer.from_pretrained(tokenizer) if tokenizer is not None
           else load_gguf_tokenizer(embedded_model_path()))
    cfg = json.loads(Path(config).read_text())
    cfg.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(dest)
    # transformers 5 names its own class; vLLM's transformers may predate it.
    tok_cfg_path = dest / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=1) + "\n")
    (dest / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return dest


def prefill_floor_ms(model_dir: Path, input_len: int, flops: float = H200_BF16_FLOPS) -> float:
    """One prompt's GEMMs at ``flops``: its weights built on the meta device, counted."""
    import torch

    from atom_core.loader import build_model
    from atom_core.loader.hf_dir import load_config

    hf_config = load_config(model_dir)
    model = build_model(hf_config, "cpu", torch.bfloat16, meta=True)
    params = params_per_token(model, getattr(hf_config, "num_experts_per_tok", 0) or 0)
    return 2.0 * params * input_len / flops * 1e3


# ----------------------------------------------------------------------------- /metrics


def scrape(base_url: str) -> dict[str, tuple[float, float]]:
    """Every histogram's (sum, count) on ``base_url``/metrics, summed over its labels."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        return parse_histograms(r.read().decode())


def parse_histograms(text: str) -> dict[str, tuple[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("histogram", "summary"):
            continue
        for s in family.samples:
            for i, suffix in enumerate(("_sum", "_count")):
                if s.name == family.name + suffix:
                    out.setdefault(family.name, [0.0, 0.0])[i] += s.value
    return {name: (v[0], v[1]) for name, v in out.items()}


def histogram_mean(before: dict[str, tuple[float, float]],
                   after: dict[str, tuple[float, float]], name: str) -> float | None:
    """Mean of the observations of ``name`` between two scrapes; None where it has none."""
    if name not in after:
        return None
    s0, c0 = before.get(name, (0.0, 0.0))
    s1, c1 = after[name]
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def time_split(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
               client_ttft_ms: float) -> dict[str, float | None]:
    """Mean ms per phase between two scrapes; with every TTFT part present, their sum and
    what the client saw beyond it."""
    split: dict[str, float | None] = {}
    for phase, name in PHASES.items():
        mean = histogram_mean(before, after, name)
        split[phase] = None if mean is None else mean * 1e3
    parts = [split[p] for p in TTFT_PARTS]
    total = sum(parts) if all(p is not None for p in parts) else None  # type: ignore[misc]
    split["sum_of_parts"] = total
    split["client_ttft"] = client_ttft_ms
    split["client_minus_sum"] = None if total is None else client_ttft_ms - total
    return split


def cpu_snapshot(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server process ``pid`` (the frontend: HTTP, tokenizing,
    detokenizing, SSE) and of everything below it (the engine), and the wall clock."""
    return {"frontend": cpu_seconds(pid),
            "engine": sum(cpu_seconds(k) for k in descendant_pids(pid)),
            "wall": time.monotonic()}


def cpu_use(before: dict[str, float], after: dict[str, float],
            output_tokens: int) -> dict[str, float]:
    """Per process group between two snapshots: the share of one core it kept busy, and its
    CPU microseconds per output token."""
    wall = after["wall"] - before["wall"]
    out = {}
    for part in ("frontend", "engine"):
        used = after[part] - before[part]
        out[f"{part}_core_share"] = used / wall if wall > 0 else 0.0
        out[f"{part}_us_per_token"] = used / max(output_tokens, 1) * 1e6
    return out


# ----------------------------------------------------------------------------- client


def parse_levels(spec: str) -> list[tuple[int, int]]:
    """``1:24,16:160`` -> [(1, 24), (16, 160)]: (concurrency, prompts)."""
    levels = []
    for item in spec.split(","):
        conc, _, prompts = item.partition(":")
        try:
            level = (int(conc), int(prompts))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"level {item!r}: expected CONCURRENCY:PROMPTS") from None
        if min(level) < 1:
            raise argparse.ArgumentTypeError(f"level {item!r}: both numbers must be positive")
        levels.append(level)
    return levels


def client_argv(model_dir: Path, base_url: str, conc: int, prompts: int, input_len: int,
                output_len: int, result_dir: Path, name: str) -> list[str]:
    return ["--backend", "vllm", "--model", str(model_dir), "--base-url", base_url,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--ignore-eos",
            "--max-concurrency", str(conc), "--num-prompts", str(prompts),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", f"{name}.json"]


def run_client(argv: list[str]) -> dict[str, Any]:
    """``atom bench serve ARGV``'s run, returning its result dict."""
    from atom_core.benchmarks.benchmark_serving import run
    from atom_core.benchmarks.cli_args import add_cli_args

    print("\n$ atom bench serve " + " ".join(argv), flush=True)
    return run(add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def post(base_url: str, path: str) -> str:
    req = urllib.request.Request(base_url + path, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read().decode()


def parse_profile_at(spec: str) -> tuple[int, float]:
    """``64:3`` -> (64, 3.0): trace the concurrency-64 level from 3 s into it."""
    conc, _, seconds = spec.partition(":")
    try:
        return int(conc), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--profile-at {spec!r}: expected C:SECONDS") from None


def run_levels(base_url: str, model_dir: Path, args: argparse.Namespace,
               tag: str, pid: int) -> list[dict[str, Any]]:
    """Warm-up requests, then every level with its /metrics scraped and the CPU time of the
    server ``pid`` and its engine read around it."""
    result_dir = Path(args.result_dir)
    shape = (args.input_len, args.output_len)
    if args.warmups:
        run_client(client_argv(model_dir, base_url, args.warmups, args.warmups, *shape,
                               result_dir, f"{tag}-warmup"))
    levels = []
    for conc, prompts in args.levels:
        name = f"{tag}-concurrency{conc}"
        before = scrape(base_url)
        cpu_before = cpu_snapshot(pid)
        profile = None
        if tag == "atom" and args.profile_at is not None and args.profile_at[0] == conc:
            profile = threading.Timer(args.profile_at[1], post, (base_url, "/start_profile"))
            profile.start()
        result = run_client(client_argv(model_dir, base_url, conc, prompts, *shape, result_dir,
                                        name))
        if profile is not None:
            profile.cancel()
            print("trace:", post(base_url, "/stop_profile"))
        cpu_after = cpu_snapshot(pid)
        after = scrape(base_url)
        levels.append({
            "concurrency": conc, "num_prompts": prompts,
            "client": {k: v for k, v in result.items() if not isinstance(v, list)},
            "client_file": str(result_dir / f"{name}.json"),
            "split": time_split(before, after, result["mean_ttft_ms"]),
            "cpu": cpu_use(cpu_before, cpu_after, result["total_output_tokens"]),
        })
    return levels


# ----------------------------------------------------------------------------- servers


def engine_flags(model_dir: Path, args: argparse.Namespace) -> list[str]:
    """The flags the server and the in-process engine share."""
    return ["--model", str(model_dir), f"--load_dummy={args.dummy}", "--max-model-len",
            str(args.max_model_len), "--device", args.device, "--no-enable-log-stats",
            *args.server_arg]


def atom_server(model_dir: Path, args: argparse.Namespace, log: Path) -> ServerProcess:
    # A long keep-alive: the client's connections idle between levels.
    extra = ["--timeout-keep-alive", "3600"]
    if args.profile_at is not None:
        extra += ["--torch-profiler-dir", str(log.parent / "traces")]
        os.environ.setdefault("ATOM_PROFILER_MAX_STEPS", str(args.profile_steps))
    return ServerProcess(None, *engine_flags(model_dir, args), *extra, log=log)


class VllmServer(ServerProcess):
    """``vllm serve DIR --load-format dummy``, started and stopped as ServerProcess does."""

    def __init__(self, model_dir: Path, max_model_len: int, log: Path) -> None:
        self.port = free_port()
        self.log_path = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
               "--load-format", "dummy", "--max-model-len", str(max_model_len),
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}"


def serve(server: ServerProcess, model_dir: Path, args: argparse.Namespace,
          tag: str) -> list[dict[str, Any]]:
    """The levels on ``server``, stopped afterwards (the engine below needs its memory)."""
    try:
        server.wait_ready(timeout=900)
        return run_levels(server.base_url, model_dir, args, tag, server.proc.pid)
    finally:
        server.stop()


def engine_tpot(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """LLMEngine in this process on the server's flags: --engine-requests prompts one after
    another (one more first, as warm-up), their mean TPOT and TTFT."""
    from atom_core import LLMEngine, SamplingParams
    from atom_core.engine.arg_utils import EngineArgs
    from atom_core.entrypoints.server_args import add_server_args

    flags = add_server_args(argparse.ArgumentParser()).parse_args(engine_flags(model_dir, args))
    engine = LLMEngine(config=EngineArgs.from_cli_args(flags).create_config())
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.engine_requests + 1, args.input_len, vocab, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    outs = [engine.generate([p], params)[0] for p in prompts][1:]
    return {"requests": len(outs),
            "tpot_ms": statistics.mean(o["tpot"] for o in outs) * 1e3,
            "ttft_ms": statistics.mean(o["ttft"] for o in outs) * 1e3}


def overhead_level(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """The level concurrency 1 ran at (else the first)."""
    return next((lv for lv in levels if lv["concurrency"] == 1), levels[0])


# ----------------------------------------------------------------------------- tables


def _fmt(values: Sequence[float | None], digits: int = 2) -> str:
    return " / ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)


def _bound_text(bounds: tuple[Bound, ...]) -> str:
    return " / ".join("-" if b is None else f"{b[0]} {b[1]:g}" for b in bounds)


def _met(values: Sequence[float], bounds: tuple[Bound, ...]) -> bool:
    checks = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t}
    return all(b is None or checks[b[0]](v, b[1]) for v, b in zip(values, bounds))


def results_table(levels: list[dict[str, Any]], shape: tuple[int, int],
                  vllm: list[dict[str, Any]] | None = None) -> str:
    """Per level and metric: ATOM, vLLM measured here (with ``vllm``), the reference, the
    target and whether it is met. The reference applies at its own levels and shape only."""
    header = ["concurrency (prompts)", "metric", "ATOM"]
    header += ["vLLM (this run)"] if vllm else []
    header += [REF_LABEL, "target", "met"]
    rows = []
    for i, lv in enumerate(levels):
        key = (lv["concurrency"], lv["num_prompts"])
        ref = REFERENCE.get(key, {}) if shape == REF_SHAPE else {}
        targets = TARGETS.get(key, {}) if shape == REF_SHAPE else {}
        for j, (metric, (label, keys)) in enumerate(METRICS.items()):
            values = [lv["client"].get(k) for k in keys]
            where = f"{key[0]} ({key[1]})" if j == 0 else str(key[0])
            row = [where, label, _fmt(values)]
            if vllm:
                row.append(_fmt([vllm[i]["client"].get(k) for k in keys]))
            bounds = targets.get(metric)
            met = "-" if bounds is None or None in values else (
                "yes" if _met(values, bounds) else "no")
            row += [" / ".join(f"{v:g}" for v in ref[metric]) if metric in ref else "-",
                    _bound_text(bounds) if bounds else "-", met]
            rows.append(row)
    return markdown_table(header, rows)


def split_table(levels: list[dict[str, Any]]) -> str:
    """Per level, the mean ms of each part of TTFT, their sum, the rest, and decode."""
    header = ["concurrency (prompts)", "client TTFT", "frontend", "queue", "prefill",
              "first-token delivery", "sum of parts", "client/connection (TTFT - sum)",
              "engine TTFT", "first decode", "client TPOT"]
    rows = []
    for lv in levels:
        s = lv["split"]
        cells = [s["client_ttft"], *(s[p] for p in TTFT_PARTS), s["sum_of_parts"],
                 s["client_minus_sum"], s["engine_ttft"], s["first_decode"],
                 lv["client"].get("mean_tpot_ms")]
        rows.append([f"{lv['concurrency']} ({lv['num_prompts']})", *(_fmt([c]) for c in cells)])
    return markdown_table(header, rows)


def cpu_table(levels: list[dict[str, Any]]) -> str:
    """Per level, how busy the frontend process and the engine's processes kept the CPU."""
    header = ["concurrency (prompts)", "frontend: share of a core", "frontend us / token",
              "engine: share of a core", "engine us / token"]
    rows = []
    for lv in levels:
        c = lv["cpu"]
        rows.append([f"{lv['concurrency']} ({lv['num_prompts']})",
                     _fmt([c["frontend_core_share"]]), _fmt([c["frontend_us_per_token"]], 1),
                     _fmt([c["engine_core_share"]]), _fmt([c["engine_us_per_token"]], 1)])
    return markdown_table(header, rows)


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path,
                   default=ROOT / "bench" / "configs" / "qwen3-8b" / "config.json",
                   help="model config.json (its vocabulary is set to the tokenizer's)")
    p.add_argument("--levels", type=parse_levels, default=parse_levels("1:24,16:160,64:384"),
                   help="CONCURRENCY:PROMPTS,... (default: 1:24,16:160,64:384)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    # Empty or zero weights make every logit equal, so every token is id 0, a special token
    # that decodes to no text: the stream would carry nothing until its end.
    p.add_argument("--dummy", default="xavier", choices=LOAD_DUMMY_MODES,
                   help="dummy weights of server and engine (default: xavier, random ones)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (server and engine)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra flag for the server and the engine, e.g. "
                        "--server-arg=--max-num-batched-tokens=4096 (repeatable)")
    p.add_argument("--warmups", type=int, default=2, help="requests before the first level")
    p.add_argument("--engine-requests", type=int, default=8,
                   help="LLMEngine's concurrency-1 requests for the overhead ratio (0: skip it)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a directory holding the tokenizer saved from the embedded GGUF, for "
                        "a machine without the GGUF (make_model_dir writes one)")
    p.add_argument("--profile-at", type=parse_profile_at, default=None,
                   help="C:SECONDS: a torch profiler trace of the concurrency-C level from "
                        "SECONDS into it (under WORKDIR/traces; read it with "
                        "bench/trace_steps.py)")
    p.add_argument("--profile-steps", type=int, default=200,
                   help="engine steps the trace holds at most (ATOM_PROFILER_MAX_STEPS)")
    p.add_argument("--vllm", action="store_true",
                   help="the same levels on vllm serve, where vLLM is installed")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the model directory and server logs go (default: a temp dir)")
    p.add_argument("--result-dir", default="bench/results/serving_gpu",
                   help="the client's per-level results, every request")
    p.add_argument("--json", default="bench/results/serving_gpu.json")
    return p.parse_args(argv)


def timed(label: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    print(f"[{label}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="atom-serving-gpu-"))
    model_dir = make_model_dir(args.config, work / "model", args.tokenizer)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shape = (args.input_len, args.output_len)
    try:
        atom = atom_server(model_dir, args, work / "atom.log")
        levels = timed("atom serve", lambda: serve(atom, model_dir, args, "atom"))
        vllm = None
        if args.vllm and importlib.util.find_spec("vllm") is None:
            print("--vllm: vLLM is not installed here; its column is left out")
        elif args.vllm:
            server = VllmServer(model_dir, args.max_model_len, work / "vllm.log")
            vllm = timed("vllm serve", lambda: serve(server, model_dir, args, "vllm"))
        engine = (timed("LLMEngine", lambda: engine_tpot(model_dir, args))
                  if args.engine_requests > 0 else None)
        floor_ms = prefill_floor_ms(model_dir, args.input_len)
    except BaseException:
        print(f"\nthe model directory and server logs are kept in {work}", file=sys.stderr)
        raise
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)

    base = overhead_level(levels)
    overhead = base["client"]["mean_tpot_ms"] / engine["tpot_ms"] if engine else None
    print(f"\n{args.config} (vocabulary: the tokenizer's {vocab}), {args.dummy} dummy weights, "
          f"{args.input_len} in / {args.output_len} out, ignore_eos; extra server flags: "
          f"{' '.join(args.server_arg) or 'none'}\n")
    print(results_table(levels, shape, vllm))
    print("\nwhere the time went, mean ms per request (server's /metrics around each level)\n")
    print(split_table(levels))
    print("\nCPU of the server's processes over each level (user + system, all threads)\n")
    print(cpu_table(levels))
    if engine:
        print(f"\nserver overhead at concurrency {base['concurrency']}: client TPOT "
              f"{base['client']['mean_tpot_ms']:.2f} ms / LLMEngine TPOT "
              f"{engine['tpot_ms']:.2f} ms = {overhead:.3f} (target <= 1.03)")
    print(f"prefill floor of one {args.input_len}-token prompt: {floor_ms:.2f} ms "
          f"(its GEMMs at {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16, the H200's measured rate)")

    out = {
        "config": str(args.config), "input_len": args.input_len, "output_len": args.output_len,
        "max_model_len": args.max_model_len, "device": args.device, "dummy": args.dummy,
        "server_args": args.server_arg, "levels": levels, "vllm_levels": vllm,
        "engine": engine, "server_overhead": overhead,
        "server_overhead_concurrency": base["concurrency"], "prefill_floor_ms": floor_ms,
        "reference": {"label": REF_LABEL, "shape": REF_SHAPE,
                      "values": {f"{c}:{n}": v for (c, n), v in REFERENCE.items()}},
        "seconds": time.perf_counter() - t0,
    }
    path = write_json(args.json, out)
    print(f"\nwrote {path} ({out['seconds']:.0f} s)")
    return out


if __name__ == "__main__":
    main()
