"""bench/mxfp4_moe.py's CPU-side pieces: the shape it reads from gpt-oss-20b's shipped
config, the crossover it reports, the tiles it would sweep, and its dry run (the MXFP4 op
through the interpreter against the same values in fp16)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import mxfp4_moe  # noqa: E402


def test_gpt_oss_20b_shape():
    assert mxfp4_moe.model_shape("gpt-oss-20b") == (32, 4, 2880, 2880, 1.702, 7.0)


def test_crossover_needs_bf16_at_every_larger_step():
    rows = [{"tokens": t, "mxfp4_us": m, "bf16_us": b}
            for t, m, b in [(1, 10, 20), (64, 30, 31), (256, 50, 45), (1024, 90, 95),
                            (4096, 300, 250)]]
    assert mxfp4_moe.crossover(rows) == 4096  # 1024 went back to MXFP4
    rows[3]["bf16_us"] = 80
    assert mxfp4_moe.crossover(rows) == 256
    assert mxfp4_moe.crossover(rows[:2]) is None


def test_candidates_skip_tiles_taller_than_four_times_an_experts_rows():
    # One token x 4 of 32 experts: 1 row an expert, tiles up to 16 rows; 4096 tokens: 512.
    assert {c["BLOCK_M"] for c in mxfp4_moe.candidates(1, 4, 32)} == {16}
    assert {c["BLOCK_M"] for c in mxfp4_moe.candidates(4096, 4, 32)} == {16, 32, 64, 128}


def test_dry_run():
    out = subprocess.run([sys.executable, str(BENCH / "mxfp4_moe.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "E=32 top-4 H=2880 I=2880" in out
    assert "rel err 0.0e+00" in out
