"""How decode attention over an fp8 cache sizes its grid (``fit_fp8_grid``): a split grid
past one wave runs unsplit where the unsplit grid fills half a wave, and an unsplit grid
past one wave takes the narrow tile where it needs fewer waves (with K/V loaded by TMA, up
to three waves of the wide tile). The residency figures are an H100's for Qwen3-8B's
kernel (3 programs an SM of the wide tile, 4 of the narrow, 132 SMs); the batch sizes
those measured in the model."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from atom_kernels_triton.decode_attention import (  # noqa: E402
    FP8_NARROW_TILE,
    FP8_TILE,
    fit_fp8_grid,
    num_kv_splits,
)

SMS = 132
KV_HEADS = 8
RESIDENT = {FP8_TILE: 3 * SMS, FP8_NARROW_TILE: 4 * SMS}


@pytest.mark.parametrize("batch,expected", [
    (16, (4, FP8_TILE)),  # 512 programs, past a wave; unsplit 128 fill under half
    (24, (2, FP8_TILE)),  # 384 programs fit as they are
    (28, (1, FP8_TILE)),  # 2 splits: 448 programs; unsplit 224 fit
    (32, (1, FP8_TILE)),  # 2 splits: 512 programs
    (48, (1, FP8_TILE)),  # 384: one wave of either tile, and the wide one's chain is shorter
    (56, (1, FP8_NARROW_TILE)),  # 448: two waves wide, one narrow
    (64, (1, FP8_NARROW_TILE)),
    (80, (1, FP8_TILE)),  # 640: two waves of either
    (128, (1, FP8_NARROW_TILE)),  # 1024: three waves wide, two narrow
    (512, (1, FP8_NARROW_TILE)),  # 4096: 11 waves wide, 8 narrow; the offline bench's batch
])
def test_grid_fits_one_wave_where_it_can(batch, expected):
    splits = num_kv_splits(batch, KV_HEADS, SMS)
    assert fit_fp8_grid(batch * KV_HEADS, splits, RESIDENT.__getitem__) == expected


@pytest.mark.parametrize("batch,expected", [
    (32, (1, FP8_TILE)),
    (64, (1, FP8_NARROW_TILE)),  # 512: two waves wide, one narrow
    (128, (1, FP8_NARROW_TILE)),
    (132, (1, FP8_NARROW_TILE)),  # 1056: the largest grid of three waves wide, two narrow
    (149, (1, FP8_TILE)),  # 1192: four waves wide, three narrow: past TMA_NARROW_MAX_WAVES
    (512, (1, FP8_TILE)),  # 4096: 11 waves wide, 8 narrow
])
def test_tma_grids_past_a_few_waves_keep_the_wide_tile(batch, expected):
    splits = num_kv_splits(batch, KV_HEADS, SMS)
    assert fit_fp8_grid(batch * KV_HEADS, splits, RESIDENT.__getitem__, tma=True) == expected


def test_a_grid_that_fits_keeps_its_splits():
    assert fit_fp8_grid(8, 32, RESIDENT.__getitem__) == (32, FP8_TILE)
    assert fit_fp8_grid(100, 1, RESIDENT.__getitem__) == (1, FP8_TILE)


@pytest.mark.parametrize("programs,splits", [(8, 32), (128, 4), (100, 1)])
def test_every_grid_asks_both_tiles(programs, splits):
    # Asking compiles a tile's kernel: a warm-up's grid that keeps the wide tile must still
    # compile the narrow one, or a later grid that needs it compiles while serving.
    asked = []
    fit_fp8_grid(programs, splits, lambda tile: asked.append(tile) or RESIDENT[tile])
    assert set(asked) == {FP8_TILE, FP8_NARROW_TILE}
