"""Sustained bf16 GEMM rate on a model's prefill shapes, with the board's power and clocks.

    python bench/gemm_power.py [--model qwen3-8b] [--tokens 16384] [--seconds 4]
        [--json bench/results/gemm_power.json]

The offline benchmark's prefill steps are cuBLAS GEMMs run back to back for tens of
seconds. A short timing (a few calls after a warm-up) catches the chip at its boost clock;
over seconds an H200 settles at its power limit and clocks down. This runs each of the
model's projections (``--tokens`` rows: one prefill step's worth) for ``--seconds`` each,
times the calls, and samples power draw and SM clock with ``nvidia-smi`` meanwhile: the
rate it prints is the ceiling the offline run's GEMMs have, and the physical limit beside
which bench/RESULTS.md puts them.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import MODELS, load_config, machine  # noqa: E402


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of a dense decoder layer's four GEMMs (qkv fused, gate/up fused)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {"qkv": (hidden, q + 2 * kv), "o_proj": (q, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


def parse_samples(lines: list[str]) -> list[tuple[float, float]]:
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
                ["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits", "-lms", "100",
                 "-i", str(torch.cuda.current_device())],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self._proc = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate(timeout=10)
            self.samples = parse_samples(out.splitlines())


def sustained(fn, seconds: float) -> tuple[int, float]:
    """(calls, wall seconds) of ``fn`` back to back for about ``seconds``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    return calls, time.perf_counter() - t0


def sustained_gemm(m: int, k: int, n: int, seconds: float) -> dict:
    """An [m, k] x [k, n] bf16 GEMM (``F.linear``, cuBLAS) back to back for ``seconds``: its
    rate, and the board's mean power and SM clock once the first second has settled."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    with PowerLog() as log:
        calls, wall = sustained(functools.partial(torch.nn.functional.linear, x, w), seconds)
    steady = log.samples[10:] or log.samples  # 100 ms samples
    watts = sum(s[0] for s in steady) / len(steady) if steady else float("nan")
    mhz = sum(s[1] for s in steady) / len(steady) if steady else float("nan")
    return {"m": m, "k": k, "n": n, "calls": calls, "wall_s": wall, "tflops": 2 * m * k * n * calls / wall / 1e12,
            "watts": watts, "sm_mhz": mhz, "samples": len(log.samples)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", choices=MODELS)
    p.add_argument("--tokens", type=int, default=16384, help="GEMM rows (a prefill step's tokens)")
    p.add_argument("--seconds", type=float, default=4.0, help="run time per shape")
    p.add_argument("--json", default="bench/results/gemm_power.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    rows = []
    print(f"{'GEMM':8s} {'M x K x N':>22s} {'TFLOP/s':>8s} {'watts':>6s} {'SM MHz':>7s}")
    for name, (k, n) in projections(load_config(args.model)).items():
        r = {"gemm": name, **sustained_gemm(args.tokens, k, n, args.seconds)}
        rows.append(r)
        print(f"{name:8s} {f'{args.tokens}x{k}x{n}':>22s} {r['tflops']:8.1f} {r['watts']:6.0f} {r['sm_mhz']:7.0f}",
              flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), "results": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
