"""bench/trace_steps.py: exact numbers on a small made-up GPU trace, and a real CPU trace of
the tiny model's engine summarised end to end."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import trace_steps  # noqa: E402


def _x(name: str, cat: str, ts: float, dur: float, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": args}


def _kernel(name: str, ts: float, dur: float, corr: int, stream: int = 7) -> dict:
    return _x(name, "kernel", ts, dur, correlation=corr, stream=stream)


# A prefill (0-100 us) launching two kernels that overlap on two streams (busy 30-130), and
# a decode (150-200 us) replaying a graph whose two kernels leave a 60 us gap (180-240).
EVENTS = [
    _x("prefill[bs=2 tok=100]", "user_annotation", 0, 100),
    _x("decode[bs=1 tok=1]", "user_annotation", 40, 10),  # nested: not a step of its own
    _x("sampler", "user_annotation", 80, 5),
    _x("prefill[bs=2 tok=100]", "gpu_user_annotation", 30, 100),  # the GPU's copy
    _x("cudaLaunchKernel", "cuda_runtime", 10, 2, correlation=1),
    _x("cuLaunchKernelEx", "cuda_driver", 20, 2, correlation=2),
    _x("decode[bs=2 tok=2]", "user_annotation", 150, 50),
    _x("cudaGraphLaunch", "cuda_runtime", 160, 5, correlation=3),
    _kernel("gemm", 30, 40, 1),
    _kernel("attn", 60, 70, 2, stream=8),
    _kernel("gemm", 170, 10, 3),
    _kernel("sample", 240, 20, 3),
    _kernel("before", -500, 10, 99),  # no launch in the trace, outside the window
    {"ph": "X", "cat": "kernel", "name": "no args", "ts": -300, "dur": 5},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 12},
    {"ph": "M", "name": "process_name", "args": {"name": "python"}},
    {"ph": "i", "name": "marker"},
]


def test_synthetic_trace_numbers():
    s = trace_steps.summarize(EVENTS, top=5)
    assert s["steps"] == {"prefill": 1, "decode": 1}
    assert s["window_ms"] == pytest.approx(0.260)  # 0 to the decode's last kernel's end
    assert s["gpu_busy_ms"] == pytest.approx(0.130)  # 30-130, 170-180, 240-260
    assert s["gpu_idle_fraction"] == pytest.approx(0.5)
    prefill, decode = s["groups"]
    assert prefill == pytest.approx({
        "kind": "prefill", "size": "tok<=256", "steps": 1, "cpu_ms": 0.1, "gpu_ms": 0.11,
        "span_ms": 0.1, "gap_ms": 0.05})
    assert decode == pytest.approx({
        "kind": "decode", "size": "bs=2", "steps": 1, "cpu_ms": 0.05, "gpu_ms": 0.03,
        "span_ms": 0.09, "gap_ms": None})
    attn, gemm = s["top_kernels"]["prefill"]
    assert attn == pytest.approx({"kernel": "attn", "count": 1, "total_ms": 0.07, "share": 7 / 11})
    assert gemm == pytest.approx({"kernel": "gemm", "count": 1, "total_ms": 0.04, "share": 4 / 11})
    assert [k["kernel"] for k in s["top_kernels"]["decode"]] == ["sample", "gemm"]
    assert s["idle_gaps"].keys() == {"decode"}
    assert s["idle_gaps"]["decode"] == pytest.approx({"gaps": 1, "ms": 0.06})


def test_report_and_json(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS, "host_name": "h", "deviceProperties": [{"name": "G"}]},
                  f)
    trace_steps.main([str(path), "--top", "1", "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert "GPU busy: 0.13 ms (union of 4 kernels), idle 50.0%" in out
    assert "| prefill | tok<=256 | 1 | 0.100 | 0.110 | 0.100 | 0.050 |" in out
    assert "| decode | bs=2 | 1 | 0.050 | 0.030 | 0.090 | - |" in out
    assert "| attn | 1 | 0.070 | 63.6% |" in out and "| gemm | 1 | 0.040" not in out
    assert "idle gaps > 50 us: 1, 0.060 ms: 0.060 ms in decode (1)" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["machine"] == {"host": "h", "gpus": ["G"]} and data["steps"]["decode"] == 1


@pytest.mark.parametrize(("kind", "bs", "tok", "label"), [
    ("decode", 1, 1, "bs=1"), ("decode", 3, 3, "bs=3-4"), ("decode", 64, 64, "bs=33-64"),
    ("prefill", 8, 1024, "tok<=1024"), ("prefill", 1, 1025, "tok<=2048"),
    ("prefill", 4, 20000, "tok>16384"),
])
def test_size_bucket(kind, bs, tok, label):
    assert trace_steps.size_bucket(kind, bs, tok)[0] == label


def test_a_trace_without_steps_is_an_error():
    with pytest.raises(ValueError, match="no prefill"):
        trace_steps.summarize([_kernel("gemm", 0, 1, 1)])


@pytest.mark.slow
def test_real_cpu_trace(tmp_path):
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams
    from atom_core.testing.tiny_models import tiny_model_dir

    engine = LLMEngine(str(tiny_model_dir("llama")), device="cpu",
                       torch_profiler_dir=str(tmp_path), enable_log_stats=False)
    engine.start_profile()
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 3,
                    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.stop_profile()  # waits for the child process that writes the .json.gz
    [trace] = (tmp_path / "rank_0").glob("*.json.gz")
    run = subprocess.run([sys.executable, str(BENCH / "trace_steps.py"), str(trace)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "steps: 1 prefill, 3 decode" in run.stdout
    assert "no GPU kernels in this trace" in run.stdout
    assert "| prefill | tok<=256 | 1 |" in run.stdout and "| decode | bs=3-4 | 3 |" in run.stdout
