"""``atom chat`` driven through stdin: each prompt is rendered from the whole
conversation, /clear forgets it, /exit and end of input (Ctrl-D) end the session with
status 0, Ctrl-C stops the reply being written and keeps the session."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from atom_core.entrypoints import chat_cmd, generate_cmd
from atom_core.entrypoints.cli import main
from atom_core.errors import InvalidRequestError
from atom_core.testing.tiny_models import tiny_model_dir


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def assistant(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


class Turns:
    """Records each turn that reaches the engine: its prompt, reply and finish reason."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prompts: list[str] = []
        self.replies: list[str] = []
        self.reasons: list[str | None] = []
        stream = generate_cmd.stream

        def recorded(engine, prompt, params, out, stop=None):
            self.prompts.append(prompt)
            text, reason = stream(engine, prompt, params, out, stop)
            self.replies.append(text)
            self.reasons.append(reason)
            return text, reason

        monkeypatch.setattr(generate_cmd, "stream", recorded)


def chat(monkeypatch, capsys, lines: str, *flags: str) -> tuple[int, Turns, str, str]:
    model = str(tiny_model_dir("llama"))
    capsys.readouterr()  # what building the tiny model printed
    turns = Turns(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    rc = main(["chat", "--model", model, "--device", "cpu",
               "--no-enable-log-stats", "--max-tokens", "6", *flags])
    out, err = capsys.readouterr()
    return rc, turns, out, err


def test_each_turn_sees_the_conversation_and_clear_forgets_it(monkeypatch, capsys):
    rc, turns, out, err = chat(monkeypatch, capsys, "Hello\n\nHow are you\n/clear\nAgain\n",
                               "--system", "Be brief")
    assert rc == 0, err  # end of input is Ctrl-D: a normal end
    system = "<|im_start|>system\nBe brief<|im_end|>\n"
    first, second, third = turns.prompts
    generation = "<|im_start|>assistant\n"
    assert first == system + user("Hello") + generation
    assert second == (system + user("Hello") + assistant(turns.replies[0]) + user("How are you")
                      + generation)
    assert third == system + user("Again") + generation  # the system prompt survives /clear
    assert "(conversation cleared)" in out
    for reply in turns.replies:  # each reply streamed to stdout
        assert reply in out
    assert err == ""


def test_exit_ends_the_session(monkeypatch, capsys):
    rc, turns, _, _ = chat(monkeypatch, capsys, "Hi\n/exit\nnever read\n")
    assert rc == 0 and turns.prompts == [user("Hi") + "<|im_start|>assistant\n"]


class CtrlCAtFirstWrite(io.StringIO):
    """A stdout at which the user presses Ctrl-C as the first reply starts to stream."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        if len(self.writes) == 1:
            signal.raise_signal(signal.SIGINT)
        return super().write(text)


def test_ctrl_c_stops_the_reply_and_keeps_the_session(monkeypatch, capsys):
    out = CtrlCAtFirstWrite()
    monkeypatch.setattr(sys, "stdout", out)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a shell's background job
    rc, turns, _, err = chat(monkeypatch, capsys, "Hi\nThen\n", "--max-tokens", "40")
    assert rc == 0, err
    first = out.writes[0]
    assert turns.reasons[0] == "abort" and turns.replies[0] == first and len(turns.prompts) == 2
    # the next turn ran, with the reply as far as it was written in the history
    assert turns.prompts[1] == (user("Hi") + assistant(first) + user("Then")
                                + "<|im_start|>assistant\n")
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_refused_turn_is_one_line_and_the_session_goes_on(monkeypatch, capsys):
    rc, turns, _, err = chat(monkeypatch, capsys, "x" * 300 + "\nHi\n", "--max-model-len", "64")
    assert rc == 0
    [line] = err.splitlines()
    assert line.startswith("error: ") and "/clear starts over" in line
    # the refused turn left nothing in the history
    assert turns.prompts[-1] == user("Hi") + "<|im_start|>assistant\n"


class FakeChat:
    def __init__(self) -> None:
        self.said: list[str] = []
        self.cleared = 0

    def reply(self, text, out, stop=None):
        self.said.append(text)
        out.write("ok")
        if text == "too long":
            raise InvalidRequestError("the prompt is too long")
        return "ok"

    def clear(self):
        self.cleared += 1


def test_the_prompt_survives_ctrl_c_and_commands_are_checked():
    lines = iter(["first", KeyboardInterrupt, "/clr", "/help", "/clear", "too long", "last"])

    def read_line() -> str:
        line = next(lines, EOFError)
        if isinstance(line, type):
            raise line
        return line

    fake, out, err = FakeChat(), io.StringIO(), io.StringIO()
    assert chat_cmd.repl(fake, read_line, out, err) == 0
    assert fake.said == ["first", "too long", "last"] and fake.cleared == 1
    assert "unknown command /clr (did you mean /clear?)" in err.getvalue()
    assert "/exit  end the session" in out.getvalue()
    assert "error: the prompt is too long (/clear starts over)" in err.getvalue()


@pytest.mark.slow
def test_atom_chat_reads_a_pipe_and_exits_0_at_its_end():
    atom = Path(sys.executable).with_name("atom")
    proc = subprocess.run(
        [str(atom), "chat", "--model", str(tiny_model_dir("llama")), "--device", "cpu",
         "--max-tokens", "4", "--no-enable-log-stats"],
        input="Hi\n/clear\nBye\n", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert ">>>" not in proc.stdout  # no prompt when stdin is not a terminal
    assert "(conversation cleared)" in proc.stdout
