"""Validate model loading and generation: four chat prompts, a warm-up, one batch.

    python -m atom_core.examples.simple_inference [engine flags] [--temperature 0.6]
"""

from __future__ import annotations

import argparse
import logging
import time

from atom_core import SamplingParams
from atom_core.engine.arg_utils import EngineArgs

PROMPTS = [
    "Introduce yourself in one sentence.",
    "List all prime numbers within 100.",
    "如何在一个月内增肌10公斤",
    "Explain what a KV cache is to a new engineer.",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    llm = EngineArgs.from_cli_args(args).create_engine()
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": p}], enable_thinking=True)
        for p in PROMPTS
    ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm.generate(["warmup"], SamplingParams(max_tokens=4))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}")
        print(
            f"  tokens in/out: {out['num_tokens_input']}/{out['num_tokens_output']}  "
            f"ttft: {out['ttft']:.3f}s  tpot: {out['tpot'] * 1000:.1f}ms  "
            f"finish: {out['finish_reason']}"
        )
    total = sum(o["num_tokens_output"] for o in outputs)
    print(
        f"\n{len(outputs)} requests, {total} tokens in {elapsed:.2f}s "
        f"({total / elapsed:.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
