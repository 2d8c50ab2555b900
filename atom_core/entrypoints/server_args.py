"""The server's command-line flags (kept apart from the server so the CLI loads fast)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from atom_core.engine.arg_utils import EngineArgs


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="bind address")
    g.add_argument(
        "--server-port", type=int, default=8000,
        help="the HTTP port clients connect to: the OpenAI and Anthropic APIs, /health, /metrics",
    )
    EngineArgs.add_cli_arg(
        g, "port", help_prefix="the engine's port, as the serving guide names it (not HTTP); "
    )
    g.add_argument(
        "--timeout-keep-alive", type=int, default=5,
        help="seconds an idle keep-alive connection is held",
    )
    g.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request"
    )
    g.add_argument(
        "--timeout-graceful-shutdown", type=_positive(float), default=20.0, metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may finish before they are aborted "
        "(default 20: under Kubernetes' default 30 s grace period, with time left to stop)",
    )
    g.add_argument(
        "--timeout-header-read", type=_positive(float), default=20.0, metavar="SECONDS",
        help="a connection must deliver each request's headers within this long, else it is "
        "closed (a slow or silent client would otherwise hold it forever; default 20)",
    )
    g.add_argument(
        "--api-key", default=None,
        help="require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY') on every route "
        "but /health, /metrics, /version and the API description (/openapi.json, /docs, /redoc)",
    )
    g.add_argument(
        "--served-model-name", default=None,
        help="the model name clients use (default: --model)",
    )
    g.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="log level of the HTTP server (uvicorn) and ATOM's loggers in its process",
    )
    g.add_argument(
        "--tool-call-parser", default="auto",
        help="tool-call wire format: a registered name (hermes, qwen, glm, kimi, kimi_k3, minimax, "
        "dsml, deepseek_v31, ...), 'none', or 'auto' (read from the chat template at start-up; "
        "never guessed from output). An unknown name is refused before the weights load",
    )
    g.add_argument(
        "--reasoning-parser", "--reasoning-dialect", dest="reasoning_parser", default="auto",
        help="reasoning dialect: a registered name (think, kimi_k3), 'none', or 'auto' (read from "
        "the chat template; inline <think> when it names none)",
    )
    add_limit_args(parser)
    EngineArgs.add_cli_args(parser, exclude=("port",))
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model, as --model says (`atom serve Qwen/Qwen3-8B`, as `vllm serve`)",
    )
    return parser


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one request may ask of the server (enforced in entrypoints/admission.py and
    http/guards.py)."""
    g = parser.add_argument_group("request limits")
    g.add_argument(
        "--max-request-body-bytes", type=_positive(int), default=64 * 2**20, metavar="BYTES",
        help="largest request body read; a larger one is refused with 413 before the rest of "
        "it is read (default 64 MiB)",
    )
    g.add_argument(
        "--max-prompts-per-request", type=_positive(int), default=1024, metavar="N",
        help="most prompts in one /v1/completions request (a list prompt); more is a 400",
    )
    g.add_argument(
        "--max-sequences-per-request", type=_positive(int), default=1024, metavar="N",
        help="most sequences one request generates: n x prompts (chat: n); more is a 400",
    )
    g.add_argument(
        "--request-timeout", type=_positive(float), default=None, metavar="SECONDS",
        help="longest a generation request may run, from its body being read to its last byte; "
        "then its generation is aborted and the client gets 504 (a stream, whose 200 went out: "
        "an error event, then its end). Default: no limit",
    )
    g.add_argument(
        "--max-queued-requests", type=_positive(int), default=None, metavar="N",
        help="most generation requests admitted but without their first token yet (tokenizing, "
        "waiting for the engine, prefilling); one more is refused with 429 and Retry-After. "
        "Default: no limit (the engine's waiting queue absorbs bursts; a benchmark sends its "
        "whole set at once)",
    )


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    return parse
