"""The server's command-line flags (kept apart from the server so the CLI loads fast)."""

from __future__ import annotations

import argparse

from atom_core.engine.arg_utils import EngineArgs


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="bind address")
    g.add_argument("--server-port", type=int, default=8000, help="HTTP port (--port is the engine's)")
    g.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle keep-alive connection is held")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
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
    EngineArgs.add_cli_args(parser)
    return parser
