import pytest

from atom_core.config import Config
from atom_core.engine.capture_traces import CaptureTracer
from atom_core.errors import ConfigError


def test_mark_trace_needs_a_profiler_dir(monkeypatch):
    monkeypatch.delenv("ATOM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ConfigError, match="--mark-trace needs"):
        Config.from_kwargs(mark_trace=True)
    config = Config.from_kwargs(mark_trace=True, torch_profiler_dir="/tmp/x")
    assert config.observability_config.mark_trace
    monkeypatch.setenv("ATOM_TORCH_PROFILER_DIR", "/tmp/y")
    assert Config.from_kwargs(mark_trace=True).observability_config.mark_trace


def test_trace_file_names_follow_the_guide(tmp_path):
    tracer = CaptureTracer(str(tmp_path))
    assert tracer.path(16).name == "bs_16_q_1_rank0.json.gz"
    assert tracer.path(4, max_q_len=2).parent == tmp_path / "capture_traces"
