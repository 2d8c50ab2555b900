"""Shared by tests/ops (CPU, TRITON_INTERPRET=1) and tests/gpu (CUDA): random paged
batches and the native reference each Triton kernel is checked against."""

from __future__ import annotations

import torch

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.attention.native import NativeAttentionBackend


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def paged_batch(
    query_lens: list[int], context_lens: list[int], block_size: int, kv_heads: int,
    head_dim: int, dtype: torch.dtype, device: str, seed: int = 0, spare_blocks: int = 3,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for sequences whose last query_lens[i] of context_lens[i] tokens are new,
    over blocks handed out in shuffled order, and a NaN-poisoned cache whose cached prefix
    slots hold random K/V (the new tokens' slots are left for the backend to write)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, cached, starts = [], [], [], [0]
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    flat = cache.view(2, -1, kv_heads, head_dim)
    for q_len, ctx, nb in zip(query_lens, context_lens, need):
        table = torch.tensor([free.pop() for _ in range(nb)])
        tables.append(table.tolist())
        pos = torch.arange(ctx)
        seq_slots = table[pos // block_size] * block_size + pos % block_size
        cached.append(seq_slots[: ctx - q_len])
        slots.extend(seq_slots[ctx - q_len :].tolist())
        starts.append(starts[-1] + q_len)
    prefix = torch.cat(cached)
    flat[:, prefix] = torch.randn(2, len(prefix), kv_heads, head_dim, generator=g).to(dtype)
    width = max(need) + 1
    bt = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=bt.to(device),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(context_lens),
    )
    return meta, cache.to(device)


def native_attention(
    q, k, v, cache: torch.Tensor, meta: AttentionMetadata, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(native output in fp32 math, the cache after the native write) - the reference."""
    ref_cache = cache.clone().float()
    backend = NativeAttentionBackend(heads, head_dim, kv_heads, head_dim**-0.5)
    out = backend.forward(q.float(), k.float(), v.float(), ref_cache, meta)
    return out, ref_cache
