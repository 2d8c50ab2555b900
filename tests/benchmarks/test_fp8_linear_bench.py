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

TILES = {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "SWAP": True, "num_warps": 4,
         "num_stages": 4}


def row(m: int, best_us: float, scaled_mm_us: float = 10.0, others: tuple = ()) -> dict:
    """A projection's timings at m rows: the W8A8 sweep's tiles (``TILES``, then any
    ``others`` as (BLOCK_N, us)) and scaled_mm."""
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    tiles = [{"BLOCK_M": block_m, **TILES, "us": best_us}]
    tiles += [{"BLOCK_M": block_m, **TILES, "BLOCK_N": bn, "us": us} for bn, us in others]
    return {"M": m, "N": 4096, "K": 4096, "scaled_mm_us": scaled_mm_us,
            "sweep_w8a8": {"best": min(tiles, key=lambda t: t["us"]), "all": tiles}}


def test_w8a8_entries_keep_winning_tiles_per_bucket():
    table = fp8_linear.w8a8_entries([row(16, 9.0), row(32, 8.0), row(64, 10.0),
                                     {"M": 256, "N": 4096, "K": 4096, "scaled_mm_us": 1.0}])
    assert set(table) == {(4096, 4096)}
    entries = table[(4096, 4096)]
    assert set(entries) == {16, 32, 64}  # 256 rows had no W8A8 sweep
    assert entries[16]["BLOCK_M"] == 16 and "us" not in entries[16]
    assert entries[32]["BLOCK_M"] == 32
    assert entries[64] is None  # a tie goes to _scaled_mm


def test_w8a8_bucket_takes_the_tiles_fastest_over_its_rows():
    # At 64 rows the 64-wide tile wins by 1 us; at 40 (also the 64-row bucket) the 128-wide
    # tile by 8: the bucket takes the 128-wide one, the least time over both.
    table = fp8_linear.w8a8_entries([row(64, 9.0, 30.0, others=((128, 10.0),)),
                                     row(40, 20.0, 30.0, others=((128, 12.0),))])
    assert table[(4096, 4096)][64]["BLOCK_N"] == 128
    # Only the bucket's rows count: 24 rows belong to the 32-row bucket.
    table = fp8_linear.w8a8_entries([row(64, 9.0, others=((128, 10.0),)),
                                     row(24, 5.0, others=((128, 3.0),))])
    assert table[(4096, 4096)][64]["BLOCK_N"] == 64
    assert table[(4096, 4096)][32]["BLOCK_N"] == 128
    # Against scaled_mm, the sums: 9 + 12 = 21 does not beat 10 + 10.
    table = fp8_linear.w8a8_entries([row(64, 9.0), row(40, 12.0, scaled_mm_us=10.0)])
    assert table[(4096, 4096)][64] is None


def test_w8a8_bucket_skips_tiles_missing_at_a_row_count():
    # The 128-wide tile failed to compile at 40 rows: its 64-row time alone cannot win.
    table = fp8_linear.w8a8_entries([row(64, 9.0, others=((128, 1.0),)), row(40, 8.0)])
    assert table[(4096, 4096)][64]["BLOCK_N"] == 64


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
