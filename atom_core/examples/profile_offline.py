"""Profile one batch offline: a warm-up, then a torch-profiled generate.

    python -m atom_core.examples.profile_offline --model PATH [engine flags] \\
        [--torch-profiler-dir ./profiler_traces] [--input-length 128] [--output-length 32] \\
        [--bs 1] [--random-input]

Traces land in ``{torch_profiler_dir}/rank_0/*.json.gz`` (TensorBoard / chrome://tracing).
The directory defaults to ATOM_TORCH_PROFILER_DIR, else ./profiler_traces. ATOM_PROFILER_MORE=1
records shapes, stacks and memory; ATOM_ENABLE_DETAILED_ANNOTATION=1 adds attention FLOP
aggregates to the step labels.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from pathlib import Path

from atom_core import SamplingParams
from atom_core.engine.arg_utils import EngineArgs

DEFAULT_DIR = "./profiler_traces"
TEXT = (
    "The history of computing is a story of abstractions layered on abstractions: switches "
    "became gates, gates became arithmetic units, and arithmetic units became processors that "
    "run programs written in languages their designers never imagined. "
)


def build_prompts(
    engine, input_length: int, bs: int, random_input: bool, seed: int = 0
) -> list[list[int]]:
    """``bs`` prompts of ``input_length`` token ids: random ids, or the text repeated."""
    if random_input or engine.tokenizer is None:
        vocab = engine.hf_config.vocab_size
        rng = random.Random(seed)
        return [[rng.randrange(vocab) for _ in range(input_length)] for _ in range(bs)]
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    ids = (ids * (input_length // max(1, len(ids)) + 1))[:input_length]
    # Distinct first tokens, so the prefix cache does not turn bs prompts into one.
    return [[(ids[0] + i) % engine.hf_config.vocab_size, *ids[1:]] for i in range(bs)]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    EngineArgs.add_cli_args(parser)
    parser.add_argument(
        "--input-length", type=int, default=128, help="input prompt length in tokens"
    )
    parser.add_argument("--output-length", type=int, default=32, help="output length in tokens")
    parser.add_argument("--bs", type=int, default=1, help="batch size (parallel requests)")
    parser.add_argument(
        "--random-input", action="store_true", help="random token ids instead of text"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.torch_profiler_dir = (
        args.torch_profiler_dir or os.environ.get("ATOM_TORCH_PROFILER_DIR") or DEFAULT_DIR
    )

    engine = EngineArgs.from_cli_args(args).create_engine()
    prompts = build_prompts(engine, args.input_length, args.bs, args.random_input, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_length, ignore_eos=True)
    # Warm up on shifted prompts: the same ones would leave the profiled prefill to the
    # prefix cache.
    vocab = engine.hf_config.vocab_size
    warmup = [[(t + 1) % vocab for t in p] for p in prompts]
    engine.generate(warmup, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))

    engine.start_profile()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    engine.stop_profile()

    trace_dir = Path(args.torch_profiler_dir) / "rank_0"
    tokens = sum(o["num_tokens_output"] for o in outputs)
    print(f"{len(outputs)} requests x {args.input_length} in / {args.output_length} out: "
          f"{tokens} tokens in {elapsed:.2f}s (profiled, so slower than unprofiled)")
    for trace in sorted(trace_dir.glob("*.json.gz")):
        print(f"trace: {trace}")
    return trace_dir


if __name__ == "__main__":
    main()
