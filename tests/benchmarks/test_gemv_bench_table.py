"""bench/gemv.py's table side on CPU: which measured points become ``TUNED`` entries, and
``--table-from`` merging stored runs (later files win per point) into the printed table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gemv  # noqa: E402
from atom_kernels_triton.gemv_config import GemvConfig  # noqa: E402

CFG = GemvConfig(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
CFG2 = GemvConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3)


def point(n, k, m, cublas, best, config=CFG):
    return {"N": n, "K": k, "M": m, "cublas_us": cublas, "best_us": best, "best_config": config}


def test_a_config_is_kept_only_where_it_beats_cublas_by_the_margin():
    lines = gemv.tuned_entries([
        point(2048, 2048, 1, 10.0, 9.0),  # 10% faster: kept
        point(2048, 2048, 16, 10.0, 9.8),  # 2%: inside the margin, cuBLAS
        point(4096, 4096, 4, 10.0, 12.0),  # slower: cuBLAS
        {"N": 4096, "K": 4096, "M": 8, "cublas_us": 10.0, "best_us": None},  # nothing compiled
    ])
    text = "\n".join(lines)
    assert "(2048, 2048): {" in text and "(4096, 4096): {" in text
    assert "1: GemvConfig(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)," in text
    assert "16: None," in text and "4: None," in text
    assert "8:" not in text


def test_entries_chosen_in_the_model_are_kept_over_the_sweeps_pick():
    # Qwen3-0.6B's one-row o_proj: the sweep's pick (CFG) loses to the table's whole-slice
    # entry; its 16-row point is the sweep's as usual.
    lines = gemv.tuned_entries([point(1024, 2048, 1, 10.0, 5.0),
                                point(1024, 2048, 16, 10.0, 5.0, CFG2)])
    text = "\n".join(lines)
    kept = gemv.TUNED[(1024, 2048)][1]
    assert kept["BLOCK_K"] == 2048 and (1024, 2048, 1) in gemv.IN_MODEL
    assert ("1: GemvConfig(BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1, num_warps=4, num_stages=2),"
            "  # chosen in the model") in text
    assert "16: GemvConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2," in text


def test_32_row_entries_survive_a_table_regenerated_from_the_sweep():
    # The sweep stops at 16 rows; the table's 32-row tile for Qwen3-8B's o_proj stays.
    text = "\n".join(gemv.tuned_entries([point(4096, 4096, 16, 10.0, 5.0, CFG2)]))
    kept = gemv.TUNED[(4096, 4096)][32]
    fields = ", ".join(f"{k}={v}" for k, v in kept.items())
    assert "32: GemvConfig(" + fields + "),  # chosen in" in text
    assert "16: GemvConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2," in text


def test_table_from_merges_runs_later_files_winning(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"results": [point(2048, 2048, 1, 10.0, 9.0),
                                             point(2048, 2048, 4, 10.0, 11.0)]}))
    second.write_text(json.dumps({"results": [point(2048, 2048, 4, 10.0, 8.0, CFG2)]}))
    gemv.main(["--table-from", str(first), str(second)])
    out = capsys.readouterr().out
    assert "1: GemvConfig(BLOCK_N=4, BLOCK_K=512," in out  # only in the first run
    assert "4: GemvConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2," in out  # the second run's point
    assert "4: None" not in out


def test_the_sweeps_leaders_are_timed_again_before_one_is_chosen():
    # Swept minima: CFG looked fastest, but timed again it is the slowest of the leaders.
    third, fourth = {**CFG, "num_stages": 3}, {**CFG, "BLOCK_N": 8}
    swept = [(9.0, CFG), (9.5, CFG2), (9.9, third), (12.0, fourth)]
    again = {(4, 2): 11.0, (64, 3): 10.0, (4, 3): 10.5}  # (BLOCK_N, num_stages) -> us
    timed = []

    def time_config(c):
        timed.append(c)
        return again[(c["BLOCK_N"], c["num_stages"])]

    assert gemv.retime_leaders(swept, time_config) == (10.0, CFG2)
    assert timed == [CFG, CFG2, third]  # the three leaders only


def test_the_32_row_sweep_holds_the_shipped_tiles_within_shared_memory():
    grid = gemv.candidates(32, 4096, 4096, 2)
    for n, k in [(4096, 4096), (4096, 12288), (2048, 4096), (6144, 4096), (24576, 4096)]:
        assert gemv.TUNED[(n, k)][32] in gemv.candidates(32, n, k, 2), (n, k)
    assert all(c["num_stages"] * (c["BLOCK_N"] + 32) * c["BLOCK_K"] * 2 <= gemv.SMEM_BYTES
               for c in grid)
    assert gemv.parse_args(["--rows", "1", "16", "32"]).rows == [1, 16, 32]
    with pytest.raises(SystemExit):
        gemv.parse_args(["--rows", "24"])


def test_a_32_row_pick_is_a_comment_until_checked_in_the_model():
    lines = gemv.tuned_entries([point(2048, 2048, 32, 10.0, 5.0, CFG2),
                                point(2048, 2048, 16, 10.0, 5.0, CFG2),
                                point(4096, 4096, 32, 10.0, 5.0, CFG2)])
    text = "\n".join(lines)
    assert ("        # 32: GemvConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, "
            "num_stages=3),  # swept") in text
    assert "        16: GemvConfig(BLOCK_N=64" in text
    kept = gemv.TUNED[(4096, 4096)][32]  # in IN_MODEL: the table's, not the sweep's
    assert "        32: GemvConfig(BLOCK_N=" + str(kept["BLOCK_N"]) in text and kept != CFG2


def test_a_candidate_sits_in_the_table_only_while_it_is_timed():
    import torch
    from atom_kernels_triton import gemv as gemv_op

    x, w = torch.randn(32, 2048), torch.randn(2048, 2048, dtype=torch.bfloat16)
    x = x.to(torch.bfloat16)
    before = {shape: dict(per_m) for shape, per_m in gemv.TUNED.items()}
    assert not gemv_op.supported(x, w, None)  # no 32-row entry for this shape: cuBLAS
    with gemv.table_entry(2048, 2048, 32, CFG2):
        assert gemv.TUNED[(2048, 2048)][32] == CFG2 and gemv_op.supported(x, w, None)
    with gemv.table_entry(4096, 4096, 32, CFG2):  # an existing entry comes back after
        assert gemv.TUNED[(4096, 4096)][32] == CFG2
    with gemv.table_entry(5, 7, 32, CFG2):  # a shape the table lacks leaves no trace
        assert (5, 7) in gemv.TUNED
    with gemv.table_entry(2048, 2048, 16, CFG2):  # other buckets take the config directly
        assert {shape: dict(per_m) for shape, per_m in gemv.TUNED.items()} == before
    assert {shape: dict(per_m) for shape, per_m in gemv.TUNED.items()} == before
