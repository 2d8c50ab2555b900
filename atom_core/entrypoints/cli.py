"""The ``atom`` command: one sub-command per job.

A mistake on the command line costs one line on stderr, never a usage block, a
traceback or a dump of the parsed arguments: ``atom bench serve: error: argument
--num-prompts: invalid int value: 'abc' (see 'atom bench serve --help')``, exit status 2
for what argparse refuses, 1 for a value a command refuses once it looks (an AtomError:
a missing file, a server that does not answer). A mistyped flag or choice gets the nearest
one suggested: ``unrecognized arguments: --tensor-paralel-size (did you mean
--tensor-parallel-size?)``. ``--help`` ends every option's help with its default.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from atom_core import __version__
from atom_core.entrypoints import bench_cmd, chat_cmd, generate_cmd, parse_cmd
from atom_core.errors import AtomError


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``known`` to a mistyped ``word``, else ""."""
    match = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {match[0]}?)" if match else ""


class AtomHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already speaks of it
    (``(default 20: under Kubernetes' grace period)`` says more than ``(default: 20.0)``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return action.help
        default = action.default
        # A list default is shown as it is typed: --cudagraph-capture-sizes 1 2 4 ...
        shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class AtomArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, naming the sub-command they belong to. Sub-command
    parsers are made of this class too (argparse makes them of their parent's class).
    The innermost parser refuses the arguments it does not know (argparse leaves that to
    the top one, whose error would name ``atom``), and records its name in the parsed
    arguments as ``command_prog`` for the errors a command raises later."""

    _has_commands = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", AtomHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs: Any) -> Any:
        self._has_commands = True
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if not self._has_commands:
            if extras:
                self._refuse(extras)
            parsed.command_prog = self.prog
        return parsed, extras

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # the top parser's own (``atom --verbose serve``)
            self._refuse(extras)
        return parsed

    def _refuse(self, extras: list[str]) -> NoReturn:
        flags = [s for s in self._option_string_actions if s.startswith("--")]
        matches = {arg: difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
                   for arg in extras if arg.startswith("--")}
        near = [(arg, match[0]) for arg, match in matches.items() if match]
        hint = ""
        if len(near) == 1:
            hint = f" (did you mean {near[0][1]}?)"
        elif near:
            hint = f" (did you mean {', '.join(f'{m} for {a}' for a, m in near)}?)"
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            if not isinstance(value, str) or action.choices is None:
                raise
            hint = did_you_mean(value, [str(c) for c in action.choices])
            raise argparse.ArgumentError(action, exc.message + hint) from None

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
    chat_cmd.add_parser(sub)
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
