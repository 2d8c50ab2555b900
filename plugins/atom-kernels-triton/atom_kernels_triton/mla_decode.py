"""Paged MLA decode in latent space (DeepSeek-V2/V3), and the latent cache write.

Every head of an MLA layer attends to one shared latent "kv head": the cached row
``[kv_c | k_pe]`` (``rank + rope`` values) is the key, its first ``rank`` values the value.
A program owns (sequence, block of heads, KV split): the heads are the rows of one tile,
so each latent tile is read once per head block, not once per head. Scores are
``q_latent . kv_c + q_pe . k_pe`` (two dots; the cache row is never split in memory).

As in decode_attention.py, splits divide each sequence's context at run time (from the
seq_lens tensor), so a grid that depends only on tensor shapes - what a CUDA graph needs -
fills the GPU at batch 1; partials carry an fp32 log-sum-exp and a second kernel merges
them. A sequence of length 0 (a graph's padding row) reads no cache and yields zeros.

The cache may be float8_e4m3fn: latent tiles are converted to the queries' dtype as they
are loaded, the one latent scale folded into the softmax scale and the output, and the
latent write stores values over that scale, saturated (kv_cache.py's ``to_cache``).

Its merge is not decode_attention's: that one finds a sequence's output row through
query_start_loc and holds a whole head's partials at once, which for a 512-wide latent
is [splits, 512] fp32 per program; this one indexes rows directly and merges the latent
in slices across programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_kernels_triton.decode_attention import num_kv_splits
from atom_kernels_triton.kv_cache import to_cache
from atom_kernels_triton.pdl import pdl_options, pdl_wait


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters; ``for_dtype`` holds the defaults, a tuning pass may pass others.

    The defaults target kv_lora_rank 512 + rope 64 on an H100/H200 and follow the grouped
    MLA decode kernel that SGLang and vLLM ship for those GPUs: 16 heads per tile (the
    smallest tl.dot M, and all of DeepSeek-V2-Lite's heads), 32 tokens per tile for 16-bit
    caches, 4 warps, 2 stages. The whole 512-wide latent stays in one tile: the [16, 512]
    fp32 accumulator is 64 registers a thread at 4 warps, and the [32, 576] 16-bit tile
    (36 KiB, x2 stages) fits shared memory, so slicing the value dimension (which would
    re-read the latents once per slice) is not needed. fp32 caches halve the token tile
    to keep the staged tiles in shared memory.
    """

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    merge_block_v: int = 128  # latent columns per merge program

    @staticmethod
    def for_dtype(dtype: torch.dtype) -> MLADecodeConfig:
        return MLADecodeConfig(block_n=16) if dtype == torch.float32 else MLADecodeConfig()


@triton.jit
def _mla_decode_kernel(
    q_ptr, q_stride_s, q_stride_h,
    qpe_ptr, qpe_stride_s, qpe_stride_h,
    cache_ptr, stride_blk, stride_slot,
    bt_ptr, bt_stride, seq_lens_ptr,
    out_ptr, out_stride_s, out_stride_h,
    po_ptr, plse_ptr,
    sm_scale, kv_scale, num_heads, block_size,
    RANK: tl.constexpr, ROPE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    s = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    s64 = s.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + s)
    # Split length rounded to whole tiles; splits past the context end do no work.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    hmask = heads < num_heads
    lmask = offs_l < RANK
    rmask = offs_r < ROPE
    q = tl.load(q_ptr + s64 * q_stride_s + heads[:, None] * q_stride_h + offs_l[None, :],
                mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_pe = tl.load(qpe_ptr + s64 * qpe_stride_s + heads[:, None] * qpe_stride_h + offs_r[None, :],
                   mask=hmask[:, None] & rmask[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row = bt_ptr + s64 * bt_stride
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        blk = tl.load(bt_row + offs_n // block_size, mask=nmask, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_blk + (offs_n % block_size) * stride_slot
        # The casts are no-ops unless the cache's dtype differs from the queries' (fp8).
        kv = tl.load(row[:, None] + offs_l[None, :], mask=nmask[:, None] & lmask[None, :],
                     other=0.0).to(q.dtype)
        k_pe = tl.load(row[:, None] + RANK + offs_r[None, :], mask=nmask[:, None] & rmask[None, :],
                       other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
        qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision=PRECISION) * qk_scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        m = m_new

    safe_l = tl.where(l_sum > 0, l_sum, 1.0)
    o = acc / safe_l[:, None]
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        o = o * kv_scale  # every split alike, so the merge of the partials is unchanged
    omask = hmask[:, None] & lmask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + s64 * out_stride_s + heads[:, None] * out_stride_h + offs_l[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        part = (s64 * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(po_ptr + part[:, None] * RANK + offs_l[None, :], o, mask=omask)
        lse = tl.where(l_sum > 0, m + tl.log2(safe_l), float("-inf"))  # base 2
        tl.store(plse_ptr + part, lse, mask=hmask)


@triton.jit
def _mla_merge_kernel(
    po_ptr, plse_ptr, out_ptr, out_stride_s, out_stride_h, num_heads,
    RANK: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    smask = offs_s < NUM_SPLITS
    vmask = offs_v < RANK
    base = (s * num_heads + h) * NUM_SPLITS
    lse = tl.load(plse_ptr + base + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence (padding row): all zero
    w = tl.exp2(lse - m)
    o = tl.load(po_ptr + (base + offs_s)[:, None] * RANK + offs_v[None, :],
                mask=smask[:, None] & vmask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + s * out_stride_s + h * out_stride_h + offs_v,
             res.to(out_ptr.dtype.element_ty), mask=vmask)


def _block_h(config: MLADecodeConfig, num_heads: int) -> int:
    return max(16, min(config.block_h, triton.next_power_of_2(num_heads)))  # tl.dot's M >= 16


def mla_num_splits(num_seqs: int, num_heads: int, num_sms: int, config: MLADecodeConfig) -> int:
    """KV splits for a batch of ``num_seqs``: about two waves of programs (a function of
    the batch shape only, so a captured graph and an eager step split alike)."""
    return num_kv_splits(num_seqs, triton.cdiv(num_heads, _block_h(config, num_heads)), num_sms,
                         waves=2)


def mla_decode_attention(
    q_latent: torch.Tensor,  # [S, H, rank]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [S, H, rope], rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]; q's dtype or fp8 e4m3
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S]; 0 reads nothing and yields zeros
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [S, H, rank]
    config: MLADecodeConfig | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Each sequence's one query, every head, attended over its cached latents: the
    softmax-weighted sum of the ``kv_c`` rows, ``[S, H, rank]`` in ``q_latent``'s dtype;
    an fp8 cache's latents read times ``kv_scale``."""
    num_seqs, num_heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    if kv_cache.shape[2] != rank + rope:
        raise ValueError(
            f"cache rows hold {kv_cache.shape[2]} values, not rank {rank} + rope {rope}"
        )
    if kv_cache.stride(2) != 1 or q_latent.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError("the latent dimension of q_latent, q_pe and kv_cache must be contiguous")
    if out is None:
        out = q_latent.new_empty(num_seqs, num_heads, rank)
    if num_seqs == 0:
        return out
    cfg = config or MLADecodeConfig.for_dtype(kv_cache.dtype)
    block_h = _block_h(cfg, num_heads)
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"
    if num_splits > 1:
        po = torch.empty((num_seqs, num_heads, num_splits, rank), dtype=torch.float32,
                         device=out.device)
        plse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                           device=out.device)
    else:
        po = plse = out  # unused
    if kv_cache.dtype == torch.float8_e4m3fn:
        scale = scale * kv_scale  # q . (stored * kv_scale) == (q . stored) * kv_scale
    grid = (num_seqs, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_kernel[grid](
        q_latent, q_latent.stride(0), q_latent.stride(1),
        q_pe, q_pe.stride(0), q_pe.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_tables, block_tables.stride(0), seq_lens,
        out, out.stride(0), out.stride(1), po, plse,
        scale, kv_scale, num_heads, kv_cache.shape[1],
        RANK=rank, ROPE=rope, NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        BLOCK_L=triton.next_power_of_2(max(rank, 16)),
        BLOCK_R=triton.next_power_of_2(max(rope, 16)),
        PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_options(out.device),
    )
    if num_splits > 1:
        block_v = min(cfg.merge_block_v, triton.next_power_of_2(rank))
        _mla_merge_kernel[(num_seqs, num_heads, triton.cdiv(rank, block_v))](
            po, plse, out, out.stride(0), out.stride(1), num_heads,
            RANK=rank, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_V=block_v, **pdl_options(out.device),
        )
    return out


@triton.jit
def _write_latent_kernel(kvc_ptr, kvc_stride, kpe_ptr, kpe_stride, cache_ptr, slot_ptr, inv,
                         RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK)
    in_c = cols < RANK
    in_pe = (cols >= RANK) & (cols < RANK + ROPE)
    c = tl.load(kvc_ptr + tok * kvc_stride + cols, mask=in_c, other=0.0)
    pe = tl.load(kpe_ptr + tok * kpe_stride + (cols - RANK), mask=in_pe, other=0.0)
    row = tl.where(in_c, to_cache(c, cache_ptr, inv), to_cache(pe, cache_ptr, inv))
    tl.store(cache_ptr + slot * (RANK + ROPE) + cols, row, mask=cols < RANK + ROPE)


def write_latent_cache(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """Store each new token's ``[kv_c | k_pe]`` at its slot of a contiguous
    ``[num_blocks, block_size, rank + rope]`` cache (an fp8 one gets the values over
    ``scale``, saturated, as the native ``store_rows`` stores them); slot -1 (padding)
    writes nothing.
    One launch, no host sync: safe inside a CUDA graph."""
    num_tokens, rank = kv_c.shape
    rope = k_pe.shape[1]
    if num_tokens == 0:
        return
    if not kv_cache.is_contiguous():
        raise ValueError("write_latent_cache needs a contiguous cache")
    if kv_c.stride(1) != 1:
        kv_c = kv_c.contiguous()
    if k_pe.stride(1) != 1:
        k_pe = k_pe.contiguous()
    _write_latent_kernel[(num_tokens,)](
        kv_c, kv_c.stride(0), k_pe, k_pe.stride(0), kv_cache, slot_mapping, 1.0 / scale,
        RANK=rank, ROPE=rope, BLOCK=triton.next_power_of_2(rank + rope),
        **pdl_options(kv_cache.device),
    )
