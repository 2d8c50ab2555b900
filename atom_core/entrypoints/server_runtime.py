"""``atom serve``: the HTTP app (openai_server.build_app) run under uvicorn.

    atom serve [--model PATH] [--server-port 8000] [engine flags]
    python -m atom_core.entrypoints.server_runtime ...
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from atom_core.entrypoints.openai_server import build_app
from atom_core.entrypoints.server_args import add_server_args
from atom_core.errors import AtomError


def main(argv: list[str] | None = None) -> int:
    parser = add_server_args(argparse.ArgumentParser(prog="atom serve", description=__doc__))
    args = parser.parse_args(argv)
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(args)
    except AtomError as exc:
        print(f"atom serve: error: {exc}", file=sys.stderr)
        return 1
    uvicorn.run(
        app, host=args.host, port=args.server_port, timeout_keep_alive=args.timeout_keep_alive,
        access_log=not args.disable_uvicorn_access_log, log_level=args.log_level,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
