"""bench/tune_fused_moe.py's CPU-side pieces: the shapes it reads from the shipped configs
(shared experts included) and the candidate tiles it would time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import tune_fused_moe  # noqa: E402


def test_model_shapes_count_shared_experts():
    assert tune_fused_moe.model_shape("deepseek-v2-lite", 1) == (64, 6, 2048, 1408, 2)
    assert tune_fused_moe.model_shape("qwen3-30b-a3b", 2) == (128, 8, 2048, 384, 0)


def test_shape_flag():
    assert tune_fused_moe.parse_shape("8,2,256,96") == (8, 2, 256, 96, 0)
    assert tune_fused_moe.parse_shape("64,6,2048,1408,2") == (64, 6, 2048, 1408, 2)
    with pytest.raises(SystemExit):
        tune_fused_moe.parse_shape("8,2,256")


def test_shared_experts_allow_taller_tiles():
    # 128 tokens x 6 of 64 experts is ~12 rows an expert (tiles up to 4 x 16 stay), but each
    # shared expert holds all 128: tiles up to the space's tallest stay candidates.
    space = {"block_m": (16, 32, 64, 128), "block_n": (64,), "block_k": (128,), "warps": (4,),
             "stages": (3,)}
    routed_only = {c["BLOCK_M"] for c in tune_fused_moe.candidates(128, 6, 64, 2, 0, space)}
    with_shared = {c["BLOCK_M"] for c in tune_fused_moe.candidates(128, 6, 64, 2, 2, space)}
    assert routed_only == {16, 32, 64} and with_shared == {16, 32, 64, 128}


def test_new_table_keeps_the_entries_chosen_in_the_model():
    from atom_kernels_triton import tuning
    from atom_kernels_triton.fused_moe_config import MoeConfig, tuned

    h200 = tuned("NVIDIA H200")
    best = MoeConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    measured = {(2048, 768): {1: {"best": best}, 64: {"best": best}}, (64, 32): {8: {"best": best}}}
    table = tune_fused_moe.new_table(h200, tuning.in_model("fused_moe", "NVIDIA H200"), measured)
    assert table[(2048, 768)][1] == h200[(2048, 768)][1]  # PERSISTENT, chosen in the model
    assert table[(2048, 768)][64] == best and table[(64, 32)] == {8: best}
    assert table[(2048, 1408)] == h200[(2048, 1408)]
    assert 64 not in h200[(2048, 768)]  # the device's table itself is untouched


def test_fp8_stacks_fit_deeper_k_tiles():
    # Three stages of 16 x 256 bf16 rows and 2 x 128 x 256 weights: 408 KiB in bf16, past
    # the shared memory; 216 KiB with e4m3 weights.
    space = {"block_m": (16,), "block_n": (128,), "block_k": (256,), "warps": (8,),
             "stages": (3,)}
    assert tune_fused_moe.candidates(32, 8, 128, 2, 0, space) == []
    assert len(tune_fused_moe.candidates(32, 8, 128, 2, 0, space, weight_bytes=1)) == 1
