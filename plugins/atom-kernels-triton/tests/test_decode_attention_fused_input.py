"""Decode attention with Qwen3's attention input fused in (``new_tokens``): the kernel norms
and rotates q and the new k itself and stores the new K/V. It must equal, bit for bit, the
two-launch path it replaces (``qk_norm_rope_cache_write``, then attention over the written
cache) - on the GPU within rounding - at every split count (8 and more take the preloading
branch), with padding rows, GQA, partial rotary and GPT-J pairing. CPU through
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import decode_attention  # noqa: E402
from atom_kernels_triton.decode_attention import NewTokenInput, paged_decode_attention  # noqa: E402
from atom_kernels_triton.qk_norm_rope import qk_norm_rope_cache_write  # noqa: E402
from triton_reference import paged_batch, rel_err, tolerance  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fused_case(context_lens, heads, kv_heads, head_dim, rot_dim, dtype, block_size=4, seed=0):
    """Raw qkv rows (q, k, v column slices of one tensor, as the model passes them), the
    other inputs of the attention input, and a cache whose new-token slots hold NaN."""
    meta, cache = paged_batch(
        [1] * len(context_lens),
        [max(n, 1) for n in context_lens],
        block_size,
        kv_heads,
        head_dim,
        dtype,
        DEVICE,
        seed,
    )
    g = torch.Generator().manual_seed(seed + 1)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    meta.seq_lens.copy_(lens)
    meta.slot_mapping[(lens == 0).to(DEVICE)] = -1  # a graph's padding row: nothing stored
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(len(context_lens), width, generator=g).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    qw = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE)
    kw = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE)
    cos_sin = torch.randn(max(512, max(context_lens) + 1), rot_dim, generator=g).to(DEVICE)
    positions = (lens - 1).clamp_min(0).long().to(DEVICE)
    positions[-1] = 3  # positions are read from the tensor, not derived from seq_lens
    return meta, cache, q, k, v, qw, kw, cos_sin, positions


def check_fused(
    contexts, heads, kv_heads, head_dim, rot_dim, dtype, num_splits, is_neox=True, block_size=4
):
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case(
        contexts, heads, kv_heads, head_dim, rot_dim, dtype, block_size
    )
    scale = head_dim**-0.5
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc)

    ref_cache = cache.clone()
    q_in, _ = qk_norm_rope_cache_write(
        q, k, v, qw, kw, 1e-6, pos, cos_sin, ref_cache, meta.slot_mapping, is_neox
    )
    ref = torch.full((len(contexts), heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    paged_decode_attention(q_in.view(ref.shape), ref_cache, *args, ref, scale, num_splits)

    out = torch.full_like(ref, float("nan"))
    new = NewTokenInput(k, v, qw, kw, 1e-6, pos, cos_sin, meta.slot_mapping, is_neox)
    paged_decode_attention(q.view(ref.shape), cache, *args, out, scale, num_splits, new_tokens=new)

    assert torch.equal(cache.isnan(), ref_cache.isnan())  # padding rows stored nothing
    if DEVICE == "cpu":
        assert torch.equal(out, ref)
        assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())
    else:
        # Compiled apart, the two kernels may contract the fp32 RoPE arithmetic into FMAs
        # differently: equal up to the last bit of the fp32 intermediate's rounding. Checked
        # per sequence and per new slot, so one wrong row is not averaged away; every other
        # slot must be untouched.
        for row in range(len(contexts)):
            if contexts[row]:
                assert rel_err(out[row], ref[row]) < tolerance(dtype), row
        flat, ref_flat = cache.flatten(1, 2), ref_cache.flatten(1, 2)  # [2, slots, kv_heads, D]
        new_slots = meta.slot_mapping[meta.slot_mapping >= 0]
        for slot in new_slots.tolist():
            assert rel_err(flat[:, slot], ref_flat[:, slot]) < tolerance(dtype), slot
        kept = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
        kept[new_slots] = False
        assert torch.equal(flat[:, kept].nan_to_num(), ref_flat[:, kept].nan_to_num())
    for counters in decode_attention._COUNTERS.values():
        assert not counters.any(), "a split counter was left non-zero"


_SHAPES = [
    (torch.float32, 8, 2, 32, 32, True),
    (torch.float16, 8, 2, 32, 32, True),
    (torch.float16, 4, 4, 16, 8, True),  # no GQA, partial rotary
    (torch.float32, 6, 2, 24, 24, False),  # GPT-J pairs, non-power-of-two head
]


# 32 splits (the most num_kv_splits gives) on one shape only: past 8 (which already
# preloads and merges in a loop) more splits only add empty ones, and each costs the
# interpreter a program.
@pytest.mark.parametrize(
    "num_splits,dtype,heads,kv_heads,head_dim,rot_dim,is_neox",
    [(n, *shape) for n in (1, 3, 8) for shape in _SHAPES] + [(32, *_SHAPES[1])],
)
def test_fused_input_equals_the_two_launch_path(
    num_splits, dtype, heads, kv_heads, head_dim, rot_dim, is_neox
):
    check_fused(
        [0, 1, 5, 33, 70, 2], heads, kv_heads, head_dim, rot_dim, dtype, num_splits, is_neox
    )


def test_fused_input_refuses_strided_heads():
    meta, cache, q, k, v, qw, kw, cos_sin, pos = fused_case([5, 9], 4, 2, 16, 16, torch.float32)
    new = NewTokenInput(k, v, qw, kw, 1e-6, pos, cos_sin, meta.slot_mapping, True)
    q_heads_apart = q.view(2, 4, 16).transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="heads contiguous"):
        paged_decode_attention(
            q_heads_apart,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            out,
            0.25,
            2,
            new_tokens=new,
        )
