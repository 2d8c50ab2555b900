"""``atom serve``: the HTTP app (http/app.build_app) run under uvicorn, and the process
around it: start-up errors, signals, shutdown, exit codes and the HTTP connections.

    atom serve [--model PATH] [--server-port 8000] [engine flags]
    python -m atom_core.entrypoints.server_runtime ...

- A bad --model, or an engine that cannot start: one line on stderr, exit code 1.
- SIGTERM or SIGINT: the listener closes, requests in flight may finish for
  --timeout-graceful-shutdown seconds; what is left is then aborted (each answers 503, a
  stream its error frame), the engine is stopped and the process exits 0.
- The engine process dies: every request in flight has its error already (EngineClient),
  so the server stops at once and exits 1, for its supervisor to restart it.
- --timeout-header-read: a connection whose request headers are not all in within that
  long is answered 408 (nothing, if it sent nothing) and closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from safetensors import SafetensorError, safe_open
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from atom_core.engine.arg_utils import EngineArgs
from atom_core.engine.client import EngineClient, dismiss, start_waiting_engines
from atom_core.entrypoints.server_args import add_server_args
from atom_core.errors import AtomError, ConfigError
from atom_core.parsing.response import check_parser_names

logger = logging.getLogger("atom.server")

ENGINE_DEATH_EXIT_CODE = 1
# After the engine died only the error frames already queued remain to be sent.
ENGINE_DEATH_DRAIN_S = 0.5
# After the drain's deadline aborts what is left, how long their error answers may take
# before uvicorn cancels the handlers outright.
ABORT_DRAIN_S = 2.0
REQUEST_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 29\r\nconnection: close\r\n\r\nrequest headers not received\n"
)


def main(argv: list[str] | None = None) -> int:
    parser = add_server_args(argparse.ArgumentParser(prog="atom serve", description=__doc__))
    args = parser.parse_args(argv)
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    """Run the server; returns only when it could not start (the exit code), else the
    process exits from here with the server's code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0 or _launched_worker(args):
        return _serve_node(args)
    # The engine processes start first, before anything here imports torch: they import
    # their modules while this one checks the flags and the model, then load the model
    # while this one imports the HTTP stack and loads the tokenizer. A check that fails
    # stops them before they have read anything. (-dp is not checked yet: bounded here.)
    waiting = start_waiting_engines(max(1, min(args.data_parallel_size, os.cpu_count() or 1)))
    try:
        resolve_model_args(args)
        engine_config = EngineArgs.from_cli_args(args).create_config()
        from atom_core.engine.annotations import profiler_timeout

        profiler_timeout()  # ATOM_PROFILER_TIMEOUT: build_app reads it; a typo fails here
        check_parser_names(args.tool_call_parser, args.reasoning_parser)
        check_model(args)  # after the flags' checks: those errors say more
        client = EngineClient(engine_config, args.served_model_name, waiting)
    except BaseException as exc:
        dismiss(waiting)
        if not isinstance(exc, AtomError):
            raise
        print(f"atom serve: error: {exc}", file=sys.stderr)
        return 1
    try:
        from atom_core.entrypoints.http.app import build_app

        app = build_app(args, lambda reason: server.engine_died(reason), client)
    except BaseException as exc:
        client.abandon()
        if not isinstance(exc, AtomError):
            raise
        print(f"atom serve: error: {exc}", file=sys.stderr)
        return 1
    runtime = _StartupErrors(app)
    config = uvicorn.Config(
        runtime, host=args.host, port=args.server_port, timeout_keep_alive=args.timeout_keep_alive,
        access_log=not args.disable_uvicorn_access_log, log_level=args.log_level,
        http=header_timeout_protocol(args.timeout_header_read), lifespan="on",
    )
    server = AtomServer(config, app, args.timeout_graceful_shutdown)
    try:
        server.run()
    except SystemExit:  # uvicorn's way out when the start-up failed
        if runtime.error is None:
            raise
    if runtime.error is not None:
        print(f"atom serve: error: {runtime.error}", file=sys.stderr)
        return 1
    # The lifespan's shutdown has stopped the engine and closed its link: nothing is left
    # to clean up, but the interpreter's teardown of torch and transformers would take
    # 1-3 s more on a 2-core VM, which a supervisor waits for before it restarts us.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)


def resolve_model_args(args: argparse.Namespace) -> None:
    """The model named positionally or by --model, a Hub repo id made a local snapshot
    directory (downloaded here, before the server starts); the repo id stays the served
    model name unless --served-model-name says otherwise."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models named: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    from atom_core.loader.hub import is_repo_id, resolve_model

    if args.model is not None and is_repo_id(args.model):
        args.served_model_name = args.served_model_name or args.model
    args.model = resolve_model(args.model, args.revision, args.download_dir)
    args.revision = None  # the directory is that revision's snapshot


def _serve_node(args: argparse.Namespace) -> int:
    """``--node-rank`` R > 0: no server here, only this node's tensor-parallel ranks, which
    join node 0's engine and exit with it."""
    from atom_core.distributed.launch import launched_rank, run_launched, run_node

    try:
        resolve_model_args(args)
        config = EngineArgs.from_cli_args(args).create_config()
        check_model(args)
        launched = launched_rank(config.parallel_config)
    except AtomError as exc:
        print(f"atom serve: error: {exc}", file=sys.stderr)
        return 1
    if launched is not None:
        return run_launched(config, launched)
    return run_node(config)


def _launched_worker(args: argparse.Namespace) -> bool:
    """A process a launcher (torchrun) started for a rank other than 0: it serves nothing.
    Whether the launch fits the flags is checked where the rank starts."""
    return args.tensor_parallel_size > 1 and os.environ.get("RANK", "0") != "0"


def check_model(args: argparse.Namespace) -> None:
    """The usual ways a --model is wrong, found before anything starts and said in one
    ConfigError: the engine process would find them too, but only after the frontend is up,
    and as a traceback."""
    if args.model is None:
        return  # the embedded default, which the loader checks
    from atom_core.loader import hf_dir
    from atom_core.loader.gguf_loader import GGUFFile

    path = Path(args.model).expanduser()
    if not path.exists():
        raise ConfigError(f"--model {path} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {path} is a directory without a config.json "
                              "(not a Hugging Face checkpoint)")
        hf_dir.load_config(path)
        if args.load_dummy is not None:
            return  # no weights are read
        for file in hf_dir.safetensors_files(path):
            try:
                with safe_open(str(file), framework="pt"):
                    pass  # the header: names, shapes, offsets covering the file
            except (SafetensorError, OSError) as exc:
                raise ConfigError(
                    f"--model {path}: {file.name} is not a readable safetensors file ({exc})"
                ) from None
    elif path.suffix == ".gguf":
        try:
            GGUFFile(path)
        except (ValueError, OSError, EOFError) as exc:
            raise ConfigError(f"--model {path} is not a readable GGUF file ({exc})") from None
    elif path.name.endswith(".json"):
        hf_dir.load_config(path)
        if args.load_dummy is None:
            raise ConfigError(f"--model {path} is a config file without weights; add --load_dummy")
    else:
        raise ConfigError(f"--model {path} is neither a directory, a .gguf file nor a config.json")


class _StartupErrors:
    """ASGI wrapper: an AtomError that fails the app's start-up (the engine could not load
    the model, ...) is kept for ``serve`` to print as one line, instead of the traceback
    uvicorn would log. Other exceptions keep their traceback: they are bugs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.error: AtomError | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        held: list[Message] = []  # the failure report, sent once the exception is known

        async def hold_failure(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                held.append(message)
            else:
                await send(message)

        try:
            await self.app(scope, receive, hold_failure)
        except AtomError as exc:
            if held:
                self.error = exc
                held[:] = [{"type": "lifespan.startup.failed", "message": ""}]
            raise
        finally:
            for message in held:
                await send(message)


class AtomServer(uvicorn.Server):
    """uvicorn's server with ATOM's shutdown: a drain bounded by ``graceful_s`` whose
    deadline aborts the requests left, an exit code, and an engine death that stops it."""

    def __init__(self, config: uvicorn.Config, app: Any, graceful_s: float) -> None:
        # uvicorn cancels the handlers only if the aborted ones do not end by themselves.
        config.timeout_graceful_shutdown = graceful_s + ABORT_DRAIN_S
        super().__init__(config)
        self.app = app
        self.graceful_s = graceful_s
        self.exit_code = 0

    def engine_died(self, reason: str) -> None:
        """EngineClient's death listener (on the event loop)."""
        logger.error("the engine process died (%s): the server stops, exit code %d",
                     reason, ENGINE_DEATH_EXIT_CODE)
        self.exit_code = ENGINE_DEATH_EXIT_CODE
        self.config.timeout_graceful_shutdown = ENGINE_DEATH_DRAIN_S
        self.should_exit = True

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        deadline = None
        if self.exit_code == 0:
            logger.info("shutting down: requests in flight have %g s to finish "
                        "(--timeout-graceful-shutdown)", self.graceful_s)
            deadline = asyncio.get_running_loop().call_later(self.graceful_s, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            if deadline is not None:
                deadline.cancel()

    def _abort_in_flight(self) -> None:
        client = getattr(self.app.state, "engine_client", None)
        if client is None:  # the engine never started
            return
        reason = f"the server is shutting down (--timeout-graceful-shutdown {self.graceful_s:g} s)"
        aborted = client.abort_all(reason)
        if aborted:
            logger.warning("aborted %d request(s) still running after %g s of draining",
                           aborted, self.graceful_s)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less its re-raising of the signal once the server is down: a server
        that drained and stopped on SIGTERM exits with its own code (0), not by the signal."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def header_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline for each request's headers (uvicorn has
    none: its keep-alive timer stops at a request's first byte, so a client trickling header
    bytes, or a new connection sending nothing, would hold a connection forever). httptools
    (llhttp, in C) rather than h11: every streamed token is a chunk this protocol frames,
    and h11 frames in Python."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._partial = False  # a request's first bytes are in, its headers are not

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._partial = True
            if self._header_timer is None:
                self._arm()  # the next request on a kept-alive connection

        def on_headers_complete(self) -> None:
            self._partial = False
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            self.logger.info("closing a connection whose request headers were not received "
                             "within %g s (--timeout-header-read)", timeout_s)
            if self._partial:
                self.transport.write(REQUEST_TIMEOUT_408)
            self.transport.close()

    return HeaderTimeoutProtocol


if __name__ == "__main__":
    sys.exit(main())
