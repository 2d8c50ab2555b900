"""bench/decode_critical_path.py's accounting on a hand-made trace: overlapping (PDL) kernels
are charged only for how far they move the chain's end, a gap is idle time charged to the
kernel before it, and repeated kernels are told apart by their predecessor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import decode_critical_path  # noqa: E402


def ev(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur}


def test_overlap_gap_and_labels():
    trace = [
        ev("_rms_norm_kernel_0d1d", 0.0, 2.0),  # any specialisation of the norm
        ev("_gemv_kernel_0", 1.0, 5.0),  # launched early: 4 us of it are past the norm's end
        ev("_decode_kernel", 3.0, 10.0),  # overlaps the GEMV: charged 13 - 6 = 7
        ev("_gemv_kernel_0", 15.0, 3.0),  # 2 us idle after attention, then 3 us
        ev("Memcpy HtoD (Pinned -> Device)", 16.0, 1.0),  # hidden inside the GEMV: charged 0
    ]
    rows, idle = decode_critical_path.critical_path(list(reversed(trace)), steps=1)
    by = {r["kernel"]: r for r in rows}
    assert set(by) == {"_rms_norm_kernel", "_gemv_kernel after _rms_norm_kernel", "_decode_kernel",
                       "_gemv_kernel after _decode_kernel", "Memcpy"}
    assert by["_rms_norm_kernel"]["critical_us_per_step"] == pytest.approx(2.0)
    assert by["_gemv_kernel after _rms_norm_kernel"]["critical_us_per_step"] == pytest.approx(4.0)
    assert by["_gemv_kernel after _rms_norm_kernel"]["duration_us_per_call"] == pytest.approx(5.0)
    assert by["_decode_kernel"]["critical_us_per_step"] == pytest.approx(7.0)
    assert by["_decode_kernel"]["idle_after_us_per_step"] == pytest.approx(2.0)
    assert by["_gemv_kernel after _decode_kernel"]["critical_us_per_step"] == pytest.approx(3.0)
    assert by["Memcpy"]["critical_us_per_step"] == 0.0
    assert idle == pytest.approx(2.0)
    # The charges and the idle time add up to the chain's span.
    assert sum(r["critical_us_per_step"] for r in rows) + idle == pytest.approx(18.0)
    assert rows[0]["kernel"] == "_decode_kernel"  # largest share first


def test_per_step_and_per_call_means():
    trace = [ev("_down_kernel", 10.0 * i, 4.0) for i in range(4)]
    rows, idle = decode_critical_path.critical_path(trace, steps=2)
    (row,) = rows
    assert row["calls_per_step"] == 2
    assert row["critical_us_per_step"] == pytest.approx(8.0)
    assert row["critical_us_per_call"] == pytest.approx(4.0)
    assert idle == pytest.approx(3 * 6.0 / 2)
