"""The tuning tables as data: every shipped file loads and names its device, a device without
one gets an empty table (the heuristics) and says so once, and the H200's files give the
launch parameters the tables had when they were Python (values taken from that code)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from atom_kernels_triton import fused_moe_config, gemv_config, tuning

H200 = "NVIDIA H200"
HEADER = ("device", "producer", "commit", "date", "configs")


def shipped() -> list[tuple[str, str]]:
    return [(p.parent.name, p.stem) for p in sorted(tuning.CONFIG_DIR.glob("*/*.json"))]


@pytest.mark.parametrize("op,stem", shipped())
def test_every_shipped_table_has_its_header_and_loads(op, stem):
    data = json.loads((tuning.CONFIG_DIR / op / f"{stem}.json").read_text())
    assert all(data.get(key) for key in HEADER), data.keys()
    assert tuning.file_stem(data["device"]) == stem
    assert len(data["commit"]) == 40 and int(data["commit"], 16) >= 0
    table = tuning.load(op, data["device"])
    assert table.path is not None and table.configs
    for shape, buckets in table.configs.items():
        assert all(isinstance(s, int) for s in shape) and buckets
        assert all(c is None or c["num_warps"] > 0 for c in buckets.values())
    assert tuning.in_model(op, data["device"]) <= {
        (*shape, b) for shape, buckets in table.configs.items() for b in buckets
    }


def test_file_names_from_device_names():
    assert tuning.file_stem("NVIDIA H200") == "NVIDIA_H200"
    assert tuning.file_stem("AMD Instinct MI300X") == "AMD_Instinct_MI300X"
    assert tuning.table_path("gemv", H200) == tuning.CONFIG_DIR / "gemv" / "NVIDIA_H200.json"


def test_an_unknown_device_gets_the_heuristics_and_says_so_once(caplog):
    with caplog.at_level(logging.INFO, logger=tuning.__name__):
        assert tuning.load("gemv", "Imaginary GPU 9000").configs == {}
        assert tuning.load("gemv", "Imaginary GPU 9000").configs == {}
    assert [r.getMessage() for r in caplog.records] == [
        "gemv: no tuning table for Imaginary GPU 9000; built-in heuristics"
    ]
    empty = gemv_config.tuned("Imaginary GPU 9000")
    assert gemv_config.get_config(1, 1024, 2048, 2, table=empty) == gemv_config.default_config(
        1, 1024, 2048, 2
    )
    assert fused_moe_config.get_config(1, 8, 128, 2048, 768, table={}) == (
        fused_moe_config.default_config(1, 8, 128)
    )


def test_cpu_tensors_read_no_table():
    assert tuning.device_name(torch.device("cpu")) is None
    assert tuning.table_for("gemv", torch.device("cpu")) is tuning.load("gemv", None).configs


def test_dump_then_load_round_trips(tmp_path):
    table = {(8, 16): {1: {"BLOCK_N": 4, "num_warps": 4}, 16: None}}
    path = tmp_path / "gemv" / "Some_GPU.json"
    tuning.dump(path, "Some GPU", table, "python bench/gemv.py", commit="0" * 40,
                date="2026-01-01", in_model=[[8, 16, 1]])
    data = json.loads(path.read_text())
    assert list(data) == [*HEADER, "in_model"]
    assert tuning.decode_configs(data["configs"]) == table


def test_a_table_names_the_commit_the_bench_was_given(tmp_path, monkeypatch):
    """A device's copied tree has no .git: a full ATOM_BENCH_COMMIT names the commit;
    anything else (a short hash) leaves it to git."""
    path = tmp_path / "t.json"
    monkeypatch.setenv("ATOM_BENCH_COMMIT", "ab" * 20)
    tuning.dump(path, "Some GPU", {}, "python bench/gemv.py")
    assert json.loads(path.read_text())["commit"] == "ab" * 20
    monkeypatch.setenv("ATOM_BENCH_COMMIT", "abababa")
    tuning.dump(path, "Some GPU", {}, "python bench/gemv.py")
    assert json.loads(path.read_text())["commit"] == tuning.git_commit()
    assert tuning.git_commit() != "abababa"


GEMV_H200 = [  # (m, n, k, elem_size) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
    ((1, 1024, 2048, 2), (4, 2048, 1, 4, 2)),
    ((1, 6144, 1024, 2), (8, 1024, 1, 4, 2)),
    ((3, 1024, 3072, 2), (32, 128, 4, 4, 4)),
    ((16, 4096, 4096, 2), (32, 256, 1, 4, 4)),
    ((24, 4096, 4096, 2), (64, 128, 2, 4, 5)),
    ((32, 24576, 4096, 2), (64, 64, 1, 4, 4)),
    ((8, 151936, 1024, 2), (64, 256, 1, 4, 3)),
    ((4, 2048, 2048, 2), None),  # cuBLAS
    ((1, 5120, 2048, 2), None),
    ((1, 151936, 4096, 2), None),
    ((20, 2048, 2048, 2), None),
    ((2, 7, 9, 2), (16, 16, 1, 4, 3)),  # not in the table: the heuristic
    ((8, 128, 2048, 4), (4, 256, 4, 4, 2)),  # an fp32 router: the FMA path's heuristic
]


@pytest.mark.parametrize("args,want", GEMV_H200)
def test_h200_gemv_configs_are_the_former_tables(args, want):
    got = gemv_config.get_config(*args, table=gemv_config.tuned(H200))
    assert (got if got is None else tuple(got.values())) == want


MOE_H200 = [  # (tokens, top_k, experts, hidden, inter) -> config
    ((1, 8, 128, 2048, 768), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4,
                                  num_stages=4, PERSISTENT=64)),
    ((20, 8, 128, 2048, 768), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2,
                                   num_stages=3, OVERLAP=True)),
    ((300, 8, 128, 2048, 768), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                    num_stages=3)),
    ((1000, 8, 128, 2048, 768), dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4,
                                     num_stages=3)),
    ((8192, 8, 128, 2048, 768), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                     num_stages=3)),
    ((1, 6, 64, 2048, 1408), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4,
                                  num_stages=3, PERSISTENT=64)),
    ((32, 6, 64, 2048, 1408), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4,
                                   num_stages=3, OVERLAP=True)),
    ((64, 6, 64, 2048, 1408), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4,
                                   num_stages=3)),
    ((8192, 6, 64, 2048, 1408), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                     num_stages=3)),
]


@pytest.mark.parametrize("args,want", MOE_H200)
def test_h200_fused_moe_configs_are_the_former_table(args, want):
    got = fused_moe_config.get_config(*args, table=fused_moe_config.tuned(H200))
    assert got == want and {k: type(v) for k, v in got.items()} == {
        k: type(v) for k, v in want.items()
    }
