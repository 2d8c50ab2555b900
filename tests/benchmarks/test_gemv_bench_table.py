"""bench/gemv.py's table side on CPU: which measured points become entries of the device's
table, and ``--table-from`` merging stored runs (later files win per point) into the table
file it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gemv  # noqa: E402
from atom_kernels_triton import tuning  # noqa: E402
from atom_kernels_triton.gemv_config import OP, GemvConfig, tuned  # noqa: E402

CFG = GemvConfig(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
CFG2 = GemvConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3)
H200 = "NVIDIA H200"
H200_TABLE = tuned(H200)


def point(n, k, m, cublas, best, config=CFG):
    return {"N": n, "K": k, "M": m, "cublas_us": cublas, "best_us": best, "best_config": config}


def test_a_config_is_kept_only_where_it_beats_cublas_by_the_margin():
    table, candidates = gemv.new_table([
        point(2048, 2048, 1, 10.0, 9.0),  # 10% faster: kept
        point(2048, 2048, 16, 10.0, 9.8),  # 2%: inside the margin, cuBLAS
        point(4096, 4096, 4, 10.0, 12.0),  # slower: cuBLAS
        {"N": 4096, "K": 4096, "M": 8, "cublas_us": 10.0, "best_us": None},  # nothing compiled
    ], {}, frozenset())
    assert table == {(2048, 2048): {1: CFG, 16: None}, (4096, 4096): {4: None}}
    assert candidates == []


def test_entries_chosen_in_the_model_are_kept_over_the_sweeps_pick():
    # Qwen3-0.6B's one-row o_proj: the sweep's pick (CFG) loses to the table's whole-slice
    # entry; its 16-row point is the sweep's as usual; shapes not measured stay.
    in_model = tuning.in_model(OP, H200)
    table, _ = gemv.new_table(
        [point(1024, 2048, 1, 10.0, 5.0), point(1024, 2048, 16, 10.0, 5.0, CFG2)], H200_TABLE,
        in_model,
    )
    assert (1024, 2048, 1) in in_model
    assert table[(1024, 2048)][1] == H200_TABLE[(1024, 2048)][1] and table[(1024, 2048)][1] != CFG
    assert table[(1024, 2048)][16] == CFG2
    assert table[(576, 2048)] == H200_TABLE[(576, 2048)]
    assert H200_TABLE[(1024, 2048)][16] != CFG2  # the device's table itself is untouched


def test_32_row_entries_survive_a_table_regenerated_from_the_sweep():
    # The sweep stops at 16 rows; the table's 32-row tile for Qwen3-8B's o_proj stays.
    table, _ = gemv.new_table(
        [point(4096, 4096, 16, 10.0, 5.0, CFG2)], H200_TABLE, tuning.in_model(OP, H200)
    )
    assert table[(4096, 4096)][32] == H200_TABLE[(4096, 4096)][32]
    assert table[(4096, 4096)][16] == CFG2


def test_table_from_merges_runs_later_files_winning(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    machine = {"gpu": "Some GPU"}
    first.write_text(json.dumps({"machine": machine, "results": [
        point(2048, 2048, 1, 10.0, 9.0), point(2048, 2048, 4, 10.0, 11.0)]}))
    second.write_text(json.dumps({"machine": machine, "results": [
        point(2048, 2048, 4, 10.0, 8.0, CFG2)]}))
    out = tmp_path / "gemv" / "Some_GPU.json"
    gemv.main(["--table-from", str(first), str(second), "--table", str(out)])
    data = json.loads(out.read_text())
    assert data["device"] == "Some GPU" and data["producer"].startswith("python bench/gemv.py")
    assert tuning.decode_configs(data["configs"]) == {(2048, 2048): {1: CFG, 4: CFG2}}
    other = tmp_path / "c.json"
    other.write_text(json.dumps({"machine": {"gpu": "Another GPU"}, "results": []}))
    with pytest.raises(SystemExit):
        gemv.main(["--table-from", str(first), str(other), "--table", str(out)])


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
        assert H200_TABLE[(n, k)][32] in gemv.candidates(32, n, k, 2), (n, k)
    assert all(
        c["num_stages"] * (c["BLOCK_N"] + 32) * c["BLOCK_K"] * 2 <= gemv.SMEM_BYTES for c in grid
    )
    assert gemv.parse_args(["--rows", "1", "16", "32"]).rows == [1, 16, 32]
    with pytest.raises(SystemExit):
        gemv.parse_args(["--rows", "24"])


def test_a_32_row_pick_is_a_candidate_until_checked_in_the_model():
    table, candidates = gemv.new_table(
        [point(2048, 2048, 32, 10.0, 5.0, CFG2), point(2048, 2048, 16, 10.0, 5.0, CFG2),
         point(4096, 4096, 32, 10.0, 5.0, CFG2)], H200_TABLE, tuning.in_model(OP, H200),
    )
    assert 32 not in table[(2048, 2048)] and table[(2048, 2048)][16] == CFG2
    assert candidates == ["2048,2048,32=64,128,2,4,3  # swept alone: check in the model first"]
    kept = H200_TABLE[(4096, 4096)][32]  # in in_model: the table's, not the sweep's
    assert table[(4096, 4096)][32] == kept != CFG2


def test_a_candidate_sits_in_the_table_only_while_it_is_timed(monkeypatch):
    import torch
    from atom_kernels_triton import gemv as gemv_op

    x, w = torch.randn(32, 2048), torch.randn(2048, 2048, dtype=torch.bfloat16)
    x = x.to(torch.bfloat16)
    table = tuning.table_for(OP, x.device)  # what the op reads for these tensors
    monkeypatch.setitem(table, (4096, 4096), {32: CFG})
    before = {shape: dict(per_m) for shape, per_m in table.items()}
    assert not gemv_op.supported(x, w, None)  # no 32-row entry for this shape: cuBLAS
    with gemv.table_entry(table, 2048, 2048, 32, CFG2):
        assert table[(2048, 2048)][32] == CFG2 and gemv_op.supported(x, w, None)
    with gemv.table_entry(table, 4096, 4096, 32, CFG2):  # an existing entry comes back after
        assert table[(4096, 4096)][32] == CFG2
    with gemv.table_entry(table, 5, 7, 32, CFG2):  # a shape the table lacks leaves no trace
        assert (5, 7) in table
    with gemv.table_entry(table, 2048, 2048, 16, CFG2):  # other buckets take the config directly
        assert {shape: dict(per_m) for shape, per_m in table.items()} == before
    assert {shape: dict(per_m) for shape, per_m in table.items()} == before
