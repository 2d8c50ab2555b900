"""``atom generate "prompt"``: one completion from the command line."""

from __future__ import annotations

import argparse
import logging
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    from atom_core.engine.arg_utils import EngineArgs

    p = sub.add_parser(
        "generate", help="generate a completion for a prompt (chat template applied)"
    )
    p.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    p.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--verbose", "-v", action="store_true", help="log engine start-up")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from atom_core.engine.arg_utils import EngineArgs
    from atom_core.sampling_params import SamplingParams

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    engine = EngineArgs.from_cli_args(args).create_engine()
    prompt = args.prompt
    if not args.raw and engine.loaded.chat_template is not None:
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, top_p=args.top_p
    )
    [out] = engine.generate([prompt], params)
    sys.stdout.write(out["text"] + "\n")
    return 0
