"""Row-wise argmax over the vocabulary: the greedy sampler's (and the exponential race's) pick.

torch's reduction gives each row one block, so at batch 32 over Qwen3's 151,936 logits it
runs 32 programs for ~10 MB, too few to fill the GPU. Here each row is cut into chunks, one
program each (a few hundred programs fill the GPU), and a second kernel picks each row's
winner among its chunks' (value, first index) pairs; chunks are in index order, so the
lowest index among the equal winners is the first one overall.

Same answer as ``torch.argmax``, ties and NaNs included: a NaN counts as larger than every
number, and the first NaN of a row wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels_triton.pdl import pdl_options, pdl_wait

CHUNK = 2048  # the fastest of 1024-8192 at [32, 151936] bf16 on an H200


@triton.jit
def _pick(x, idx, valid, NONE: tl.constexpr):
    """(winning value, its index) among ``x`` (indices ``idx``; ``valid`` lanes only)."""
    nan = (x != x) & valid
    any_nan = tl.max(nan.to(tl.int32), 0) > 0
    key = tl.where(nan, float("inf"), x)
    best = tl.max(key, 0)
    won = tl.where(any_nan, nan, valid & (key == best))
    return tl.where(any_nan, float("nan"), best), tl.min(tl.where(won, idx, NONE), 0)


@triton.jit
def _chunk_kernel(x_ptr, stride, vocab, val_ptr, idx_ptr, n_chunks, CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < vocab
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=valid, other=float("-inf"))
    x = x.to(val_ptr.dtype.element_ty)  # exact: fp32 holds every fp16/bf16 value
    best, at = _pick(x, offs, valid, 2**31 - 1)
    tl.store(val_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, at)


@triton.jit
def _row_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < n_chunks
    v = tl.load(val_ptr + row * n_chunks + offs, mask=valid, other=float("-inf"))
    i = tl.load(idx_ptr + row * n_chunks + offs, mask=valid, other=2**31 - 1)
    _, at = _pick(v, i, valid, 2**31 - 1)
    tl.store(out_ptr + row, at.to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: see the module docstring."""
    if x.dim() != 2:
        raise ValueError(f"argmax takes [rows, vocab] logits, got shape {tuple(x.shape)}")
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows == 0:
        return out
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    n_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(rows * n_chunks,
                       dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                       device=x.device)
    idx = torch.empty(rows * n_chunks, dtype=torch.int32, device=x.device)
    pdl = pdl_options(x.device)
    _chunk_kernel[(rows, n_chunks)](x, x.stride(0), vocab, vals, idx, n_chunks, CHUNK=chunk,
                                    num_warps=4, **pdl)
    _row_kernel[(rows,)](vals, idx, out, n_chunks, BLOCK=triton.next_power_of_2(n_chunks),
                         num_warps=1, **pdl)
    return out
