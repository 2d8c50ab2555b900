"""Host time of an eager prefill step: how long the engine's host takes to queue one step
of a fresh prompt (with or without running decodes beside it), against the GPU time of
that step, and where the host's time goes (cProfile, by own time).

    python bench/prefill_host.py [--config bench/configs/qwen3-8b/config.json]
        [--cases 512:0,2048:60] [--steps 10] [--top 30]

The engine runs with --async-scheduling, as a server does: ``step()`` returns once the
step is queued, so its wall time is the host's share. A step whose host time exceeds its
GPU time leaves the GPU idle: at concurrency 1 that is time to first token, under load
it is throughput.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import ROOT, random_prompts, stamp, write_json  # noqa: E402


def parse_cases(spec: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in (item.split(":") for item in spec.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cases {spec!r}: expected LEN:DECODES,...") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "bench/configs/qwen3-8b/config.json")
    p.add_argument("--cases", type=parse_cases, default=parse_cases("512:0,2048:60"),
                   help="PROMPT_LEN:DECODES,...: a fresh prompt of PROMPT_LEN tokens queued "
                        "beside DECODES running decodes")
    p.add_argument("--steps", type=int, default=10, help="prefill steps timed (after 2 warm-up)")
    p.add_argument("--top", type=int, default=30, help="cProfile rows printed")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json", default="bench/results/prefill_host.json")
    return p.parse_args(argv)


def measure(engine, prompt_len: int, decodes: int, steps: int, top: int) -> dict:
    """Time ``steps`` steps that each queue one fresh prompt beside ``decodes`` decodes."""
    from atom_core import SamplingParams

    vocab = engine.hf_config.vocab_size
    cuda = engine.device.type == "cuda"
    running = []
    if decodes:
        running = engine.add_request(random_prompts(decodes, 16, vocab, seed=2),
                                     SamplingParams(temperature=0.0, max_tokens=10_000,
                                                    ignore_eos=True))
        for _ in range(3):
            engine.step()
    one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    host, gpu = [], []
    prof = cProfile.Profile()
    for i, prompt in enumerate(random_prompts(steps + 2, prompt_len, vocab, seed=3)):
        engine.step()  # the step before: decodes only
        if cuda:
            torch.cuda.synchronize()
        (rid,) = engine.add_request([prompt], one)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        if events:
            events[0].record()
        timed = i >= 2  # two warm-up steps
        t0 = time.perf_counter()
        if timed:
            prof.enable()
        engine.step()  # queues the prompt's step (async scheduling: no wait for it)
        if timed:
            prof.disable()
        t1 = time.perf_counter()
        if events:
            events[1].record()
            torch.cuda.synchronize()
        if timed:
            host.append((t1 - t0) * 1e3)
            gpu.append(events[0].elapsed_time(events[1]) if events else float("nan"))
        while rid in engine._requests:  # finish it, so the next prompt's step is alike
            engine.step()
    for rid in running:
        engine.abort_request(rid)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())
    print(f"a {prompt_len}-token prompt beside {decodes} decodes, {len(host)} steps: host time "
          f"to queue the step median {statistics.median(host):.2f} ms (min {min(host):.2f}); "
          f"GPU time of the step median {statistics.median(gpu):.2f} ms\n")
    return {"prompt_len": prompt_len, "decodes": decodes, "host_ms": host, "gpu_ms": gpu,
            "cprofile": out.getvalue()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from atom_core import LLMEngine

    engine = LLMEngine(str(args.config), load_dummy="xavier", device=args.device,
                       max_model_len=args.max_model_len, enable_log_stats=False,
                       cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128])
    cases = [measure(engine, n, d, args.steps, args.top) for n, d in args.cases]
    result = {**stamp(), "config": str(args.config), "cases": cases}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
