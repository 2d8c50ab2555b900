"""bench/gpu_timing.py's command line for the kernel benches (decode_attention.py,
mla_decode.py), on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_timing  # noqa: E402

DOC = "Times a kernel.\n\nMore text."
SHAPES = ["a bs1", "b bs32"]


def test_defaults_and_choices(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench"])
    args = gpu_timing.shape_args(DOC, "out.json", SHAPES, "tile")
    assert (args.json, args.default_only, args.shapes) == ("out.json", False, SHAPES)
    monkeypatch.setattr(sys, "argv", ["bench", "--default-only", "--shapes", "b bs32", "--json", "x.json"])
    args = gpu_timing.shape_args(DOC, "out.json", SHAPES, "tile")
    assert (args.json, args.default_only, args.shapes) == ("x.json", True, ["b bs32"])
    monkeypatch.setattr(sys, "argv", ["bench", "--shapes", "c"])
    with pytest.raises(SystemExit):
        gpu_timing.shape_args(DOC, "out.json", SHAPES, "tile")
