"""``atom parse``: read a model's raw output the way the server does, and print the message.

    atom parse --tool-call-parser qwen --tools tools.json < model_output.txt

prints ``{"content", "reasoning_content", "tool_calls": [{"name", "arguments"}],
"finish_reason"}``. It is the server's reader (ResponseParser / ResponseReader), so
``--chunk-size N`` (the text fed N characters at a time, as a stream would) prints the
same message as the whole text at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from atom_core.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "parse", help="split raw model output into content, reasoning and tool calls"
    )
    p.add_argument(
        "--tool-call-parser", required=True,
        help="tool-call format name, 'none', or 'auto' (needs --chat-template)",
    )
    p.add_argument(
        "--reasoning-dialect", default="auto",
        help="reasoning dialect name, 'none', or 'auto' (default: from --chat-template, "
        "else inline <think>)",
    )
    p.add_argument(
        "--chat-template", type=Path,
        help="model directory or template file (.jinja, encoding_*.py)",
    )
    p.add_argument("--tools", type=Path, help="JSON file holding the request's tools list")
    p.add_argument("--tool-choice", help="auto | none | required | a tool name | a JSON object")
    p.add_argument(
        "--chunk-size", type=int, default=0,
        help="feed N characters at a time (default: all at once)",
    )
    p.add_argument(
        "--starts-in-reasoning", action="store_true",
        help="the output begins inside the reasoning channel (the prompt opened it)",
    )
    p.add_argument(
        "--finish-reason", default="stop", help="the engine's finish reason (stop, length)"
    )
    p.set_defaults(func=run_parse)


def _tool_choice(raw: str | None) -> Any:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    if raw.lstrip().startswith("{"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--tool-choice is not valid JSON: {exc}") from exc
    return {"type": "function", "function": {"name": raw}}


def _tools(path: Path | None) -> list[Any] | None:
    if path is None:
        return None
    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--tools {path}: {exc}") from exc
    if isinstance(tools, dict) and "tools" in tools:  # a whole request body
        tools = tools["tools"]
    if not isinstance(tools, list):
        raise ConfigError(f"--tools {path}: expected a JSON list of tools")
    return tools


def run_parse(args: argparse.Namespace) -> int:
    from atom_core.parsing.chat_encoders import load_chat_encoder
    from atom_core.parsing.response import ResponseParser

    if args.chunk_size < 0:
        raise ConfigError("--chunk-size must be 0 (whole) or positive")
    encoder = load_chat_encoder(args.chat_template) if args.chat_template else None
    if args.chat_template and encoder is None:
        raise ConfigError(f"--chat-template {args.chat_template}: no chat template found there")
    parser = ResponseParser.resolve(encoder, args.tool_call_parser, args.reasoning_dialect)
    reader = parser.reader(
        starts_in_reasoning=True if args.starts_in_reasoning else None,
        prompt=None,
        tools=_tools(args.tools),
        tool_choice=_tool_choice(args.tool_choice),
    )
    text = sys.stdin.read()
    size = args.chunk_size or max(len(text), 1)
    for i in range(0, len(text), size):
        reader.feed(text[i : i + size])
    reader.finish(args.finish_reason)
    print(json.dumps(reader.result().as_dict(), ensure_ascii=False, indent=2))
    return 0
