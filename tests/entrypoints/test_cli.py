"""The ``atom`` command's parser: --help shows every option's default, ``atom serve``
puts the engine's --port with its own ports, and mistakes are met with the nearest
flag, choice or parser name (difflib), still on one line."""

from __future__ import annotations

import argparse
import re

import pytest

from atom_core.entrypoints.cli import AtomHelpFormatter, build_parser, main


def sub_parser(*names: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in names:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


def help_text(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def sections(text: str) -> dict[str, str]:
    """--help's argument groups by title ("server", "model config", ...)."""
    parts = re.split(r"^(\S[^\n]*):\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("command", [("serve",), ("generate",), ("chat",)])
def test_every_option_shows_its_default(command):
    parser = sub_parser(*command)
    formatter = AtomHelpFormatter(parser.prog)
    options = [a for a in parser._actions
               if a.option_strings and a.default is not argparse.SUPPRESS]
    assert len(options) > 10
    for action in options:
        assert action.help, action.option_strings
        assert "default" in formatter._get_help_string(action).lower(), action.option_strings


def test_serve_help_prints_the_defaults(capsys):
    text = " ".join(help_text(capsys, "serve").split())
    assert "--host HOST bind address (default: 0.0.0.0)" in text
    assert ("(tokens per block); default: the largest page size the model's attention "
            "backends prefer on the device, else 16 --" in text)
    assert "--disable-uvicorn-access-log no log line per HTTP request (default: False)" in text
    # a list is shown as it is typed, and a help that states its default keeps its words
    assert "batch sizes captured as CUDA graphs (default: 1 2 4 8 16 24" in text
    assert "(default: the embedded SmolLM2-135M-Instruct)" in text
    assert "(default 20: under Kubernetes'" in text and "(default: 20.0)" not in text


def test_the_engine_port_sits_with_the_server_ports(capsys):
    groups = sections(help_text(capsys, "serve"))
    server = " ".join(groups["server"].split())
    assert re.search(r"--server-port SERVER_PORT the HTTP port clients connect to.*"
                     r"\(default: 8000\) --port PORT the engine's port", server), server
    assert "(default: 8006)" in server
    assert all("--port " not in body for title, body in groups.items() if title != "server")
    # where the command is no server, --port stays with the engine's flags
    generate = sections(help_text(capsys, "generate"))
    assert "--port PORT" in generate["observability config"]


def test_a_mistyped_flag_is_suggested(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--tensor-paralel-size", "2"])
    assert exit_.value.code == 2
    assert one_line_error(capsys) == (
        "atom serve: error: unrecognized arguments: --tensor-paralel-size "
        "(did you mean --tensor-parallel-size?) (see 'atom serve --help')"
    )
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--max-tokns=3", "--temprature", "0", "--zzzzzz"])
    line = one_line_error(capsys)
    assert ("unrecognized arguments: --max-tokns=3 --temprature 0 --zzzzzz (did you mean "
            "--max-tokens for --max-tokns=3, --temperature for --temprature?)") in line
    with pytest.raises(SystemExit):
        main(["--verison"])
    assert "(did you mean --version?)" in one_line_error(capsys)


def test_a_mistyped_choice_or_command_is_suggested(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--log-level", "inof"])
    assert one_line_error(capsys).endswith(
        "'error') (did you mean info?) (see 'atom serve --help')")
    with pytest.raises(SystemExit):
        main(["genrate", "hi"])
    assert "invalid choice: 'genrate'" in one_line_error(capsys)


@pytest.mark.parametrize(
    "flag, typo, message",
    [
        ("--tool-call-parser", "hermse",
         "unknown tool-call parser 'hermse' (did you mean hermes?)"),
        ("--reasoning-parser", "thnik", "unknown reasoning parser 'thnik' (did you mean think?)"),
        ("--reasoning-dialect", "kimi_k4", "unknown reasoning parser 'kimi_k4' (did you mean "
         "kimi_k3?)"),
        ("--tool-call-parser", "zzzz", "unknown tool-call parser 'zzzz'; known: "),
    ],
)
def test_a_mistyped_parser_name_is_suggested_before_weights_load(capsys, tmp_path, flag, typo,
                                                                 message):
    # tmp_path holds no model: the name is refused before anything reads one
    assert main(["serve", "--model", str(tmp_path), flag, typo]) == 1
    line = one_line_error(capsys)
    assert line.startswith(f"atom serve: error: {message}"), line
    assert "hermes" in line or "think" in line  # the known names follow
