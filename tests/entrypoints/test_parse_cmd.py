"""``atom parse``: the server's reader on stdin, printed as a message."""

from __future__ import annotations

import io
import json

import pytest

from atom_core.entrypoints.cli import main
from tests.parsing.shared_templates import template_path

OUTPUT = (
    "<think>The user wants weather.</think>Let me check.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\nOne moment."
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def atom_parse(monkeypatch, capsys, args, stdin=OUTPUT):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["parse", *args])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else out.err)


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    return str(path)


@pytest.mark.parametrize("chunk", ["0", "1", "3", "64"])
def test_prints_the_message_at_every_chunk_size(monkeypatch, capsys, tools_file, chunk):
    args = ["--tool-call-parser", "qwen", "--tools", tools_file, "--chunk-size", chunk]
    rc, msg = atom_parse(monkeypatch, capsys, args)
    assert rc == 0
    assert msg == {
        "content": "Let me check.\n\nOne moment.",
        "reasoning_content": "The user wants weather.",
        "tool_calls": [
            {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}
        ],
        "finish_reason": "tool_calls",
    }


def test_tool_choice_none_keeps_the_answer(monkeypatch, capsys, tools_file):
    args = ["--tool-call-parser", "qwen", "--tools", tools_file, "--tool-choice", "none"]
    rc, msg = atom_parse(monkeypatch, capsys, args)
    expected = ("Let me check.\n\nOne moment.", [], "stop")
    assert (msg["content"], msg["tool_calls"], msg["finish_reason"]) == expected


def test_auto_from_a_chat_template(monkeypatch, capsys):
    rc, msg = atom_parse(
        monkeypatch, capsys,
        ["--tool-call-parser", "auto", "--chat-template", str(template_path("qwen3_coder"))],
    )
    assert rc == 0 and msg["tool_calls"][0]["name"] == "get_weather"


def test_an_unknown_format_is_a_clear_error(monkeypatch, capsys):
    rc, err = atom_parse(monkeypatch, capsys, ["--tool-call-parser", "nope"])
    assert rc == 1 and "unknown tool-call parser 'nope'" in err and "hermes" in err
