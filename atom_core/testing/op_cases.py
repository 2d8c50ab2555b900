"""Inputs shared by an op's reference tests and a kernel plugin's tests of the same op, so
that both hold the kernel to the same cases."""

from __future__ import annotations

import torch


def _rand(*shape: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def qk_norm_rope_case(
    dtype: torch.dtype, q_heads: int = 4, kv_heads: int = 2, head: int = 32, rot_dim: int = 32,
    tokens: int = 5, blocks: int = 6, block_size: int = 4, device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """``qk_norm_rope_cache_write``'s inputs as Qwen3 passes them (q, k, v column slices of
    one qkv projection output): (q, k, v, q_weight, k_weight, positions, cos_sin, cache
    filled with NaN, slots with -1 padding)."""
    qkv = _rand(tokens, (q_heads + 2 * kv_heads) * head, dtype=dtype, seed=0, device=device)
    q = qkv[:, : q_heads * head]
    k = qkv[:, q_heads * head : (q_heads + kv_heads) * head]
    v = qkv[:, (q_heads + kv_heads) * head :]
    qw = _rand(head, dtype=dtype, seed=1, device=device)
    kw = _rand(head, dtype=dtype, seed=2, device=device)
    cos_sin = _rand(64, rot_dim, dtype=torch.float32, seed=3, device=device)
    pos = torch.tensor([0, 7, 3, 63, 12, 5, 9][:tokens], device=device)
    slots = torch.tensor([3, 17, -1, 0, 22, -1, 8][:tokens], device=device)
    cache = torch.full((2, blocks, block_size, kv_heads, head), float("nan"), dtype=dtype,
                       device=device)
    return q, k, v, qw, kw, pos, cos_sin, cache, slots


def expected_kv_cache(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``cache`` with the valid tokens' k and v stored at their slots; padding untouched."""
    kvh, d = cache.shape[-2:]
    ref = cache.clone()
    flat = ref.view(2, -1, kvh, d)
    valid = slots >= 0
    flat[0, slots[valid]] = k[valid].reshape(-1, kvh, d).to(cache.dtype)
    flat[1, slots[valid]] = v[valid].reshape(-1, kvh, d).to(cache.dtype)
    return ref


def moe_checkpoint(
    num_experts: int, hidden: int, inter: int, num_shared: int, seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Per-expert routed tensors and one shared MLP of intermediate size num_shared * inter,
    named as a transformers DeepSeek checkpoint names them (under ``mlp.``)."""
    g = torch.Generator().manual_seed(seed)
    weights = []
    for e in range(num_experts):
        weights += [
            (f"mlp.experts.{e}.gate_proj.weight", torch.randn(inter, hidden, generator=g) / 4),
            (f"mlp.experts.{e}.up_proj.weight", torch.randn(inter, hidden, generator=g) / 4),
            (f"mlp.experts.{e}.down_proj.weight", torch.randn(hidden, inter, generator=g) / 3),
        ]
    shared = num_shared * inter
    return weights + [
        ("mlp.shared_experts.gate_proj.weight", torch.randn(shared, hidden, generator=g) / 4),
        ("mlp.shared_experts.up_proj.weight", torch.randn(shared, hidden, generator=g) / 4),
        ("mlp.shared_experts.down_proj.weight", torch.randn(hidden, shared, generator=g) / 3),
    ]
