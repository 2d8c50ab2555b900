"""bench/gemm_power.py's host-side pieces: the model's GEMM shapes and the power log's parser."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gemm_power import parse_samples, projections  # noqa: E402
from gpu_models import load_config  # noqa: E402


def test_qwen3_8b_projection_shapes():
    # 32 query heads and 8 kv heads of 128, hidden 4096, intermediate 12288.
    assert projections(load_config("qwen3-8b")) == {
        "qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
    }


def test_power_samples_skip_unreadable_lines():
    lines = ["682.51, 1500", "[N/A], 1980", "", "690.0, 1455", "garbage"]
    assert parse_samples(lines) == [(682.51, 1500.0), (690.0, 1455.0)]
