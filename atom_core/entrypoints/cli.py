"""The ``atom`` command: one sub-command per job.

A mistake on the command line costs one line on stderr, never a usage block, a
traceback or a dump of the parsed arguments: ``atom bench serve: error: argument
--num-prompts: invalid int value: 'abc' (see 'atom bench serve --help')``, exit status 2
for what argparse refuses, 1 for a value a command refuses once it looks (an AtomError:
a missing file, a server that does not answer).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from atom_core import __version__
from atom_core.entrypoints import bench_cmd, generate_cmd, parse_cmd
from atom_core.errors import AtomError


class AtomArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, naming the sub-command they belong to. Sub-command
    parsers are made of this class too (argparse makes them of their parent's class).
    The innermost parser refuses the arguments it does not know (argparse leaves that to
    the top one, whose error would name ``atom``), and records its name in the parsed
    arguments as ``command_prog`` for the errors a command raises later."""

    _has_commands = False

    def add_subparsers(self, **kwargs: Any) -> Any:
        self._has_commands = True
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if not self._has_commands:
            if extras:
                self.error(f"unrecognized arguments: {' '.join(extras)}")
            parsed.command_prog = self.prog
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        message = message.replace("\n", " ")
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


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
    parser = AtomArgumentParser(prog="atom", description="ATOM LLM inference engine")
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
        message = str(exc).replace("\n", " ")
        print(f"{args.command_prog}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
