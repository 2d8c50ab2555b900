"""The Triton argmax vs torch.argmax (the native op), on CPU through TRITON_INTERPRET=1 or
on a GPU when there is one: equal indices, ties, NaNs and -inf rows included. Skipped where
triton is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import argmax as triton_argmax  # noqa: E402
from atom_kernels_triton.hooks import triton_ops  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.ops.native.sampling import argmax as native_argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rows(n, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g).to(dtype).to(DEVICE)


def check(x):
    got = triton_argmax.argmax(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got.cpu(), native_argmax(x.cpu()))


def test_registered():
    assert triton_ops()["argmax"] is triton_argmax.argmax
    assert resolve_op("argmax", "cpu") is native_argmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 1000, 2048, 5000])
def test_matches_native(dtype, vocab):
    check(rows(3, vocab, dtype, seed=vocab))


def test_float64_keeps_its_precision():
    x = torch.zeros(1, 100, dtype=torch.float64, device=DEVICE)
    x[0, 10] = 1.0
    x[0, 80] = 1.0 + 1e-12  # equal in fp32
    check(x)
    assert triton_argmax.argmax(x).item() == 80


@pytest.mark.parametrize("chunk", [16, 64])
def test_many_chunks(monkeypatch, chunk):
    # Small chunks: a row spans many programs, and the second kernel picks among them.
    monkeypatch.setattr(triton_argmax, "CHUNK", chunk)
    x = rows(4, 1000, torch.float32)
    check(x)
    x[1, 3 * chunk + 5] = x[1].max() + 1  # the winner in a middle chunk
    x[2, -1] = x[2].max() + 1  # ... in the last, partial chunk
    check(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_index(monkeypatch, dtype):
    monkeypatch.setattr(triton_argmax, "CHUNK", 16)
    x = torch.zeros(3, 100, dtype=dtype, device=DEVICE)
    x[0, [7, 40, 90]] = 2.0  # equal maxima in different chunks
    x[1, [33, 34]] = 1.0  # in one chunk
    check(x)  # row 2: all equal, index 0
    assert triton_argmax.argmax(x).tolist() == [7, 33, 0]


def test_nan_and_inf(monkeypatch):
    monkeypatch.setattr(triton_argmax, "CHUNK", 16)
    x = rows(5, 100, torch.float32)
    x[0, 50] = float("inf")
    x[1, 60] = float("nan")
    x[1, 20] = float("inf")  # a NaN beats +inf, as in torch.argmax
    x[2, [70, 30]] = float("nan")  # the first NaN wins
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, :] = float("nan")
    check(x)
    assert triton_argmax.argmax(x).tolist() == [50, 60, 30, 0, 0]


def test_strided_rows_and_empty_batch():
    x = rows(4, 300, torch.float32)
    check(x[:, :200])  # rows of stride 300
    check(x[::2])
    assert triton_argmax.argmax(x[:0]).shape == (0,)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rows, vocab"):
        triton_argmax.argmax(torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="empty row"):
        triton_argmax.argmax(torch.zeros(2, 0, device=DEVICE))
