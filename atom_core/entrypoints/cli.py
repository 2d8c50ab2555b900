"""The ``atom`` command: one sub-command per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from atom_core import __version__
from atom_core.entrypoints import bench_cmd, generate_cmd, parse_cmd
from atom_core.errors import AtomError


def _cmd_plugins(args: argparse.Namespace) -> int:
    from atom_core.plugins import plugin_state

    reports = [r.as_dict() for r in plugin_state().reports]
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    for r in reports:
        print(f"{r['name']} {r['version']}")
        if r["declined"]:
            print(f"  declined: {r['declined']}")
        for hook, names in r["registered"].items():
            print(f"  {hook}: {', '.join(names)}")
        if not r["declined"] and not r["registered"]:
            print("  (registered nothing)")
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from atom_core.entrypoints.server_args import add_server_args

    add_server_args(p)


def _cmd_serve(args: argparse.Namespace) -> int:
    from atom_core.entrypoints.server_runtime import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom", description="ATOM LLM inference engine")
    parser.add_argument("--version", action="version", version=f"atom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list installed plugins and what each registered")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_serve_args(p)
    p.set_defaults(func=_cmd_serve)
    generate_cmd.add_parser(sub)
    parse_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except AtomError as exc:
        print(f"atom: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
