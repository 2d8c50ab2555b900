"""bench/common.py's host-side pieces on CPU: the markdown table, the stamped JSON, the
commit it names, the power log's parser and the kernel benches' command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402

DOC = "Times a kernel.\n\nMore text."
SHAPES = ["a bs1", "b bs32"]


def test_markdown_table():
    assert common.markdown_table(["model", "ms"], [["qwen3-8b", 4.5], ["qwen3-0.6b", "-"]]) == (
        "| model | ms |\n|---|---|\n| qwen3-8b | 4.5 |\n| qwen3-0.6b | - |")


def test_write_json_stamps_machine_commit_and_date(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_BENCH_COMMIT", "abc1234")
    path = common.write_json(tmp_path / "results" / "x.json", {"rows": [1, 2]})
    data = json.loads(path.read_text())
    assert data["rows"] == [1, 2] and data["commit"] == "abc1234"
    assert data["date"][:2] == "20" and data["machine"]["cpus"] >= 1
    common.write_json(path, {"machine": "given"})  # a bench's own machine entry wins
    assert json.loads(path.read_text())["machine"] == "given"


def test_commit_names_this_checkout(monkeypatch):
    monkeypatch.delenv("ATOM_BENCH_COMMIT", raising=False)
    head = common.commit()
    if head.startswith("unknown"):
        pytest.skip("not a git checkout")
    assert len(head.removesuffix("+dirty")) >= 7


def test_power_samples_skip_unreadable_lines():
    lines = ["682.51, 1500", "[N/A], 1980", "", "690.0, 1455", "garbage"]
    assert common.parse_power_samples(lines) == [(682.51, 1500.0), (690.0, 1455.0)]


def test_shape_args_defaults_and_choices(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench"])
    args = common.shape_args(DOC, "out.json", SHAPES, "tile")
    assert (args.json, args.default_only, args.shapes) == ("out.json", False, SHAPES)
    monkeypatch.setattr(sys, "argv", ["bench", "--default-only", "--shapes", "b bs32",
                                      "--json", "x.json"])
    args = common.shape_args(DOC, "out.json", SHAPES, "tile")
    assert (args.json, args.default_only, args.shapes) == ("x.json", True, ["b bs32"])
    monkeypatch.setattr(sys, "argv", ["bench", "--shapes", "c"])
    with pytest.raises(SystemExit):
        common.shape_args(DOC, "out.json", SHAPES, "tile")



def test_shape_args_block_size_only_where_asked(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench"])
    assert common.shape_args(DOC, "out.json", SHAPES, "tile", block_size=16).block_size == 16
    assert not hasattr(common.shape_args(DOC, "out.json", SHAPES, "tile"), "block_size")
    monkeypatch.setattr(sys, "argv", ["bench", "--block-size", "64"])
    assert common.shape_args(DOC, "out.json", SHAPES, "tile", block_size=16).block_size == 64
    with pytest.raises(SystemExit):  # a bench without pages has no such flag
        common.shape_args(DOC, "out.json", SHAPES, "tile")


def test_shape_args_tma_override(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench"])
    assert common.shape_args(DOC, "out.json", SHAPES, "tile", tma=True).tma is None
    monkeypatch.setattr(sys, "argv", ["bench", "--tma", "0"])
    assert common.shape_args(DOC, "out.json", SHAPES, "tile", tma=True).tma == 0
    monkeypatch.setattr(sys, "argv", ["bench", "--tma", "2"])
    with pytest.raises(SystemExit):
        common.shape_args(DOC, "out.json", SHAPES, "tile", tma=True)
