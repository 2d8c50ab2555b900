"""``atom chat``: talk with the model in the terminal, over its chat template.

The engine runs in this process, as for ``atom generate``. Each reply streams as it is
generated and joins the history the next prompt is rendered from. Ctrl-C stops the reply
being written (at the next engine step; what was written stays in the history) and keeps
the session; Ctrl-D or ``/exit`` ends it (status 0); ``/clear`` forgets the conversation.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from atom_core.entrypoints import generate_cmd

if TYPE_CHECKING:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

PROMPT = ">>> "
COMMANDS = {
    "/clear": "forget the conversation (the system prompt stays)",
    "/exit": "end the session (also Ctrl-D)",
    "/help": "this list",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    from atom_core.engine.arg_utils import EngineArgs

    p = sub.add_parser(
        "chat", help="talk with the model: a REPL that keeps the conversation",
        description=__doc__,
    )
    p.add_argument("--system", default=None, help="a system prompt, first in every prompt")
    generate_cmd.add_sampling_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


class Chat:
    """One conversation: its messages and the engine that answers them."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, system: str | None = None):
        self.engine = engine
        self.params = params
        self.start: list[dict[str, Any]] = (
            [{"role": "system", "content": system}] if system else []
        )
        self.messages = list(self.start)

    def clear(self) -> None:
        self.messages = list(self.start)

    def reply(self, text: str, out: TextIO, stop: threading.Event | None = None) -> str:
        """Stream the model's reply to ``text`` to ``out``; both join the history (an
        interrupted reply as far as it got). A refused turn (the conversation has grown
        past --max-model-len) raises AtomError and leaves the history as it was."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.engine.apply_chat_template(messages)
        answer, _ = generate_cmd.stream(self.engine, prompt, self.params, out, stop)
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        return answer


@contextlib.contextmanager
def ctrl_c_sets(stop: threading.Event) -> Iterator[None]:
    """While inside, SIGINT sets ``stop`` instead of raising KeyboardInterrupt: the engine
    finishes its step and the request is aborted between steps, never mid-step."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def repl(chat: Chat, read_line: Callable[[], str], out: TextIO, err: TextIO) -> int:
    """Read lines until EOF (``read_line`` raises EOFError) or /exit; returns 0."""
    from atom_core.errors import AtomError

    while True:
        try:
            line = read_line().strip()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: drop the line, keep the session
            out.write("\n")
            continue
        if not line:
            continue
        if line.startswith("/"):
            if line in ("/exit", "/quit"):
                return 0
            if line == "/clear":
                chat.clear()
                out.write("(conversation cleared)\n")
            elif line == "/help":
                out.writelines(f"{name}  {what}\n" for name, what in COMMANDS.items())
            else:
                match = difflib.get_close_matches(line.split()[0], list(COMMANDS), n=1)
                hint = f" (did you mean {match[0]}?)" if match else " (/help lists them)"
                err.write(f"unknown command {line.split()[0]}{hint}\n")
            continue
        stop = threading.Event()
        try:
            with ctrl_c_sets(stop):
                chat.reply(line, out, stop)
        except AtomError as exc:
            err.write(f"error: {exc} (/clear starts over)\n")
            continue
        out.write("\n")
        out.flush()


def _terminal_reader() -> Callable[[], str]:
    """``input`` with line editing and history on a terminal; plain lines from a pipe
    (no prompt: the output is then the replies alone)."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (importing it gives input() line editing)
        return lambda: input(PROMPT)

    def read_line() -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    return read_line


def run(args: argparse.Namespace) -> int:
    from atom_core.errors import ConfigError

    engine = generate_cmd.start_engine(args)
    if engine.loaded.chat_template is None:
        raise ConfigError("this model has no chat template; `atom generate --raw` takes "
                          "a raw prompt")
    chat = Chat(engine, generate_cmd.sampling_params(args, engine), args.system)
    if sys.stdin.isatty():
        print(f"chatting with {engine.loaded.source}; /help lists the commands, Ctrl-D ends")
    return repl(chat, _terminal_reader(), sys.stdout, sys.stderr)
