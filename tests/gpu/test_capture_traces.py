"""--mark-trace on the GPU: one gzip Chrome trace per captured size, kernels on its GPU track."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402


def test_one_trace_per_captured_size(tmp_path):
    LLMEngine(str(tiny_model_dir("qwen3")), enable_log_stats=False, max_model_len=128,
              max_num_seqs=8, cudagraph_capture_sizes=[1, 2, 4], mark_trace=True,
              torch_profiler_dir=str(tmp_path))
    files = sorted(p.name for p in (tmp_path / "capture_traces").iterdir())
    assert files == ["bs_1_q_1_rank0.json.gz", "bs_2_q_1_rank0.json.gz", "bs_4_q_1_rank0.json.gz"]
    events = json.loads(gzip.open(tmp_path / "capture_traces" / files[0]).read())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # the warm-up forward ran kernels
