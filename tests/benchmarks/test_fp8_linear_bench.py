"""bench/fp8_linear.py's CPU-side pieces: the W8A8 table a sweep writes (the Triton GEMM's
tiles only at bucket row counts where they beat torch._scaled_mm) and the dry run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import fp8_linear  # noqa: E402


def row(m: int, best_us: float, scaled_mm_us: float = 10.0) -> dict:
    tiles = {"BLOCK_M": m, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "SWAP": True,
             "num_warps": 4, "num_stages": 4}
    return {"M": m, "N": 4096, "K": 4096, "scaled_mm_us": scaled_mm_us,
            "sweep_w8a8": {"best": {**tiles, "us": best_us}}}


def test_w8a8_entries_keep_winning_tiles_at_bucket_rows():
    table = fp8_linear.w8a8_entries([row(16, 9.0), row(24, 5.0), row(32, 8.0), row(64, 10.0),
                                     {"M": 256, "N": 4096, "K": 4096, "scaled_mm_us": 1.0}])
    assert set(table) == {(4096, 4096)}
    entries = table[(4096, 4096)]
    assert set(entries) == {16, 32, 64}  # 24 rows is no bucket; 256 had no W8A8 sweep
    assert entries[16]["BLOCK_M"] == 16 and "us" not in entries[16]
    assert entries[32]["BLOCK_M"] == 32
    assert entries[64] is None  # a tie goes to _scaled_mm


def test_dry_run_checks_every_fp8_path():
    out = subprocess.run([sys.executable, str(BENCH / "fp8_linear.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.count("W8A8 GEMM rel err") == 4 and out.count("weight-only rel err") == 8
    # Each fp8 path against the reference, on the four projections scaled down.
    errors = [float(line.rsplit("rel err", 1)[1].split()[0].rstrip(","))
              for line in out.splitlines() if "rel err" in line]
    assert len(errors) == 14 and max(errors) < 1e-2, errors


def test_sweep_flag():
    assert fp8_linear.parse_args([]).sweep == []
    assert fp8_linear.parse_args(["--sweep"]).sweep == ["wonly", "w8a8"]
    assert fp8_linear.parse_args(["--sweep", "w8a8"]).sweep == ["w8a8"]
    with pytest.raises(SystemExit):
        fp8_linear.parse_args(["--sweep", "gemv"])
