"""``atom generate "prompt"``: one completion from the command line, streamed to stdout
as the engine produces it."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from atom_core.engine.llm_engine import LLMEngine, RequestOutput
    from atom_core.sampling_params import SamplingParams


# What a sampling flag left out falls back to when the model's generation config
# (--generation-config) does not set it either: greedy, replies of a terminal's length.
SAMPLING_DEFAULTS: dict[str, float | int] = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 128}
_FROM_MODEL = "default: the model's generation config, else"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The flags ``atom generate`` and ``atom chat`` share: sampling and start-up logging.
    A sampling flag given wins; one left out takes the model's generation config."""
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0: greedy ({_FROM_MODEL} 0)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens in a reply ({_FROM_MODEL} 128)")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling's mass ({_FROM_MODEL} 1)")
    p.add_argument("--verbose", "-v", action="store_true", help="log engine start-up")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from atom_core.engine.arg_utils import EngineArgs

    p = sub.add_parser(
        "generate", help="generate a completion for a prompt (chat template applied)"
    )
    p.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    p.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    add_sampling_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def start_engine(args: argparse.Namespace) -> LLMEngine:
    from atom_core.engine.arg_utils import EngineArgs

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return EngineArgs.from_cli_args(args).create_engine()


def sampling_params(args: argparse.Namespace, engine: LLMEngine) -> SamplingParams:
    """The flags given, field by field over the model's generation config, merged as the
    server merges a request's fields (``GenerationDefaults.apply``), over
    ``SAMPLING_DEFAULTS``."""
    from atom_core.sampling_params import SamplingParams

    given = {name for name in SAMPLING_DEFAULTS if getattr(args, name) is not None}
    flags = {name: getattr(args, name) if name in given else value
             for name, value in SAMPLING_DEFAULTS.items()}
    return engine.generation_defaults.apply(SamplingParams(**flags), given)


def stream(
    engine: LLMEngine, prompt: str, params: SamplingParams, out: TextIO,
    stop: threading.Event | None = None,
) -> tuple[str, str | None]:
    """Generate for ``prompt``, writing each step's new text to ``out`` as it comes
    (flushed, so that a pipe sees it too). Returns the whole text and the finish reason;
    ``stop`` set between two steps aborts the request there (reason "abort")."""
    pieces: list[str] = []
    reasons: list[str | None] = []

    def on_output(output: RequestOutput) -> None:
        if output.text:
            pieces.append(output.text)
            out.write(output.text)
            out.flush()
        if output.finished:
            reasons.append(output.finish_reason)

    [request_id] = engine.add_request([prompt], params, stream_callback=on_output)
    while not reasons:
        if stop is not None and stop.is_set():
            engine.abort_request(request_id)
            return "".join(pieces), "abort"
        engine.step()
    return "".join(pieces), reasons[0]


def run(args: argparse.Namespace) -> int:
    engine = start_engine(args)
    prompt = args.prompt
    if not args.raw and engine.loaded.chat_template is not None:
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
    try:
        stream(engine, prompt, sampling_params(args, engine), sys.stdout)
    except KeyboardInterrupt:  # Ctrl-C: what was written stays; no traceback
        sys.stdout.write("\n")
        return 130
    sys.stdout.write("\n")
    return 0
