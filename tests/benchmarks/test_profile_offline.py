"""examples/profile_offline on CPU with the tiny model: a gzip Chrome trace with the steps in it."""

from __future__ import annotations

import gzip
import json

import pytest

from atom_core.examples import profile_offline
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


def test_profile_offline_writes_a_trace(tmp_path, capsys):
    trace_dir = profile_offline.main([
        "--model", str(tiny_model_dir("llama")), "--torch-profiler-dir", str(tmp_path / "traces"),
        "--input-length", "24", "--output-length", "4", "--bs", "2", "--random-input",
    ])
    assert trace_dir == tmp_path / "traces" / "rank_0"
    [trace] = list(trace_dir.glob("*.json.gz"))
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    assert sum(e.get("ph") == "X" for e in events) > 50
    names = {e.get("name", "") for e in events}
    assert any("linear" in n or "mm" in n for n in names)  # the forward's GEMMs are in it
    assert any(n.startswith("prefill[bs=") for n in names)  # the runner labels its steps
    assert any(n.startswith("decode[bs=2") for n in names)
    assert f"trace: {trace}" in capsys.readouterr().out


def test_default_dir_is_env_then_profiler_traces(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATOM_TORCH_PROFILER_DIR", str(tmp_path / "from-env"))
    args = ["--model", str(tiny_model_dir("llama")), "--input-length", "8", "--output-length", "2"]
    assert profile_offline.main(args) == tmp_path / "from-env" / "rank_0"
    monkeypatch.delenv("ATOM_TORCH_PROFILER_DIR")
    trace_dir = profile_offline.main(args)
    assert trace_dir.resolve() == (tmp_path / "profiler_traces" / "rank_0").resolve()
    assert list(trace_dir.glob("*.json.gz"))
