"""The Triton fused_moe (and its expert alignment) vs the native reference, on CPU
through TRITON_INTERPRET=1 with tiny shapes. Skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton.fused_moe import fused_moe  # noqa: E402
from atom_kernels_triton.fused_moe_config import MoeConfig, get_config, token_bucket  # noqa: E402
from atom_kernels_triton.moe_align import align_by_expert, aligned_capacity  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.ops.native.moe import fused_moe as native_fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles keep the interpreter quick; BLOCK_K below H and I exercises the K loop.
TINY = MoeConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)


def moe_inputs(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights = torch.rand(tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def check(x, w13, w2, weights, ids, config=TINY):
    got = fused_moe(x, w13, w2, weights, ids, config=config)
    ref = native_fused_moe(x, w13, w2, weights, ids)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < tolerance(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (5, 1), (7, 3), (19, 2)])
def test_matches_native(dtype, tokens, top_k):
    # H and I not multiples of the tiles: masked edges in every dimension.
    check(*moe_inputs(tokens, 6, top_k, 40, 24, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_uneven_loads_and_idle_experts(dtype):
    x, w13, w2, weights, _ = moe_inputs(21, 8, 2, 32, 16, dtype)
    # Expert 1 takes all 21 tokens (two blocks of 16, the second mostly padding), 7 and 3
    # take 10 each and 6 one; experts 0, 2, 4 and 5 get none.
    second = torch.tensor([7 if t % 2 == 0 else 3 for t in range(21)])
    second[4] = 6
    ids = torch.stack([torch.ones(21, dtype=torch.long), second], dim=1).to(DEVICE)
    check(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_out_of_range_ids_are_skipped(dtype):
    x, w13, w2, weights, ids = moe_inputs(9, 5, 3, 32, 16, dtype)
    ids[0, 1], ids[3, 0], ids[5, 2] = -1, 5, 100
    ids[7] = -1  # a token with no expert of this rank: its output is zero
    check(x, w13, w2, weights, ids)
    assert not fused_moe(x, w13, w2, weights, ids, config=TINY)[7].any()


def test_unwritten_rows_never_reach_the_output(monkeypatch):
    # No kernel writes the intermediate's padding rows or the per-pair rows of pairs without
    # an expert (torch.empty, no memset); poisoned with NaN, any read of them that reached a
    # token's output would show.
    x, w13, w2, weights, ids = moe_inputs(9, 5, 3, 32, 16, torch.float32)
    ids[0, 1], ids[5, 2] = -1, 100
    ids[7] = -1
    ref = native_fused_moe(x, w13, w2, weights, ids)
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    got = fused_moe(x, w13, w2, weights, ids, config=TINY)
    assert not got.isnan().any()
    assert rel_err(got, ref) < tolerance(x.dtype)


def test_default_config_path():
    # No config: the table's default for these shapes (BLOCK_M 16 at this load).
    check(*moe_inputs(3, 4, 2, 64, 32, torch.float32), config=None)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_layout(block_m):
    experts, g = 5, torch.Generator().manual_seed(3)
    ids = torch.randint(-1, experts + 2, (11, 3), generator=g)
    pairs, block_expert = align_by_expert(ids, experts, block_m)
    flat = ids.reshape(-1)
    assert pairs.numel() == aligned_capacity(flat.numel(), experts, block_m)
    assert block_expert.numel() == pairs.numel() // block_m
    real = pairs < flat.numel()
    # Every in-range pair once, none of the others.
    in_range = ((flat >= 0) & (flat < experts)).nonzero().flatten()
    assert torch.equal(pairs[real].long().sort().values, in_range)
    # Each block holds one expert's pairs, in token order, and unused blocks none.
    for b, e in enumerate(block_expert.tolist()):
        rows = pairs[b * block_m : (b + 1) * block_m]
        rows = rows[rows < flat.numel()].long()
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all() and torch.equal(rows, rows.sort().values)
    assert block_expert[block_expert >= 0].diff().ge(0).all()


def test_config_table():
    assert [token_bucket(t) for t in (1, 2, 3, 32, 33, 256)] == [1, 2, 4, 32, 64, 256]
    small = get_config(1, 8, 128, 2048, 768)
    large = get_config(4096, 8, 128, 2048, 768)
    assert small["BLOCK_M"] <= large["BLOCK_M"]


def test_tuned_table_covers_its_buckets_and_defers_past_them():
    from atom_kernels_triton.fused_moe_config import default_config, tuned

    h200 = tuned("NVIDIA H200")
    table = h200[(2048, 768)]

    def config(*args):
        return get_config(*args, h200)

    assert config(1, 8, 128, 2048, 768) == table[1]
    assert config(20, 8, 128, 2048, 768) == table[32]  # nearest tuned bucket above
    assert config(9, 8, 128, 2048, 768) == table[32]
    assert config(2, 6, 64, 2048, 1408) == h200[(2048, 1408)][32]
    assert config(8192, 8, 128, 2048, 768) == table[16384]
    # Past the largest tuned bucket, the shape heuristic.
    assert config(40000, 8, 128, 2048, 768) == default_config(40000, 8, 128)
    # Prefill sizes of a shape tuned only for decode use the heuristic, not a decode tile.
    assert config(8192, 6, 64, 2048, 1408) == default_config(8192, 6, 64)
    assert config(8192, 6, 64, 2048, 1408)["BLOCK_M"] > h200[(2048, 1408)][32]["BLOCK_M"]


def test_a_prefill_entry_never_serves_a_decode_batch():
    """A tuned bucket serves smaller ones only while their rows per expert stay in its
    regime: the 2048 bucket's tall tiles are for prefill, and the buckets from 64 to 1024
    tokens (4-64 rows an expert at k 8 of 128) keep the heuristic's."""
    from atom_kernels_triton import fused_moe_config as cfg

    tall = MoeConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    mid = MoeConfig(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    decode = MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=3)
    table = {(64, 32): {32: decode, 512: mid, 2048: tall}}
    for tokens in range(33, 2049):
        got, case = get_config(tokens, 8, 128, 64, 32, table), cfg.regime(tokens, 8, 128)
        if case == 2:  # 1025 tokens on: 64+ rows an expert
            assert got == tall, tokens
        elif token_bucket(tokens) <= 512:  # 257-512 tokens: the 512 entry; 33-256: decode rows
            assert got == (mid if tokens > 256 else cfg.default_config(tokens, 8, 128)), tokens
        else:
            assert got == cfg.default_config(tokens, 8, 128), tokens


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m",
    [(1, 8, 128, 16), (5, 3, 5, 4), (32, 8, 128, 16), (64, 8, 66, 16), (9, 6, 64, 1),
     (64, 8, 128, 64), (100, 5, 160, 32),
     (256, 8, 128, 16)],
)
@pytest.mark.parametrize("shared", [0, 2])
def test_decode_align_equals_torch_layout(tokens, top_k, experts, block_m, shared, monkeypatch):
    # The decode-size kernel must lay rows out exactly as the torch path: same rows,
    # same token order within each expert, same block owners; out-of-range ids get no row.
    # Shared experts (the last ``shared`` of the E) exist only as slots after the routed.
    from atom_kernels_triton import moe_align

    from atom_core.ops.native.moe import with_shared_experts

    g = torch.Generator().manual_seed(tokens * 100 + experts)
    ids = torch.randint(-1, experts + 2, (tokens, top_k), generator=g)
    full = with_shared_experts(torch.ones(tokens, top_k), ids, experts,
                               shared)[1] if shared else ids
    flat = full.reshape(-1)
    capacity = aligned_capacity(flat.numel(), experts, block_m)
    small = moe_align._align_small(ids, flat.numel(), top_k + shared, experts, shared, block_m,
                                   capacity)
    ref = moe_align._align_torch(flat, experts, block_m, capacity)
    assert torch.equal(small[0], ref[0]) and torch.equal(small[1], ref[1])
    # The op takes one or the other by size (256 x 8 pairs and 2 shared slots a token: torch),
    # the kernel with these arguments: the interpreter is not run a second time for it.
    asked = []
    monkeypatch.setattr(moe_align, "_align_small", lambda *a: asked.append(a) or small)
    assert torch.equal(align_by_expert(ids, experts, block_m, shared)[0], ref[0])
    if asked:
        [(got_ids, *rest)] = asked
        assert torch.equal(got_ids, ids)
        assert rest == [flat.numel(), top_k + shared, experts, shared, block_m, capacity, None]
    assert bool(asked) == (tokens * (top_k + shared) <= moe_align.SMALL_PAIRS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_shared_experts_are_implicit_slots(dtype, tokens):
    # Two of the 8 experts are shared: every token takes them with weight 1.0 after its
    # routed choices. The same as the native op on the explicit [T, k + 2] choices.
    from atom_core.ops.native.moe import with_shared_experts

    x, w13, w2, weights, ids = moe_inputs(tokens, 8, 3, 40, 24, dtype)
    ids = ids % 6  # routed ids among the first 6
    ids[0, 1] = -1  # a routed slot of another rank: skipped, the shared ones still count
    got = fused_moe(x, w13, w2, weights, ids, num_shared_experts=2, config=TINY)
    full_weights, full_ids = with_shared_experts(weights, ids, 8, 2)
    assert rel_err(got, native_fused_moe(x, w13, w2, full_weights, full_ids)) < tolerance(dtype)
    assert rel_err(got,
                   native_fused_moe(x, w13, w2, weights, ids,
                                    num_shared_experts=2)) < tolerance(dtype)
    assert torch.equal(got, fused_moe(x, w13, w2, full_weights, full_ids, config=TINY))


PERSISTENT = MoeConfig(**TINY, PERSISTENT=4)
OVERLAP = MoeConfig(**TINY, OVERLAP=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k,shared", [(1, 2, 0), (7, 3, 0), (19, 2, 2)])
@pytest.mark.parametrize("variant", [PERSISTENT, OVERLAP], ids=["persistent", "overlap"])
def test_counted_launches_equal_two_launches(dtype, tokens, top_k, shared, variant):
    # The same tiles in one launch, or the down tiles waiting on their block's counter (the
    # interpreter runs programs, and launches, in turn: this checks the tiles' indexing, not
    # the waits); out-of-range ids and shared slots included. Bitwise: same sums, same order.
    x, w13, w2, weights, ids = moe_inputs(tokens, 8, top_k, 40, 24, dtype)
    ids[0, 0] = -1
    ids = ids % (8 - shared) if shared else ids
    two = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=TINY)
    one = fused_moe(x, w13, w2, weights, ids, num_shared_experts=shared, config=variant)
    assert torch.equal(one, two)
    assert rel_err(one,
                   native_fused_moe(x, w13, w2, weights, ids,
                                    num_shared_experts=shared)) < tolerance(dtype)


@pytest.mark.parametrize("variant", [PERSISTENT, OVERLAP], ids=["persistent", "overlap"])
def test_counted_launches_read_deferred_norms(variant):
    from atom_core.ops.deferred_norm import DeferredNorm

    x, w13, w2, weights, ids = moe_inputs(5, 6, 2, 32, 16, torch.float32)
    h, gamma = x, torch.rand(32, device=x.device) + 0.5
    sumsq = (h * h).reshape(5, 2, 16).sum(-1).T.contiguous()  # two column blocks' partial sums
    deferred = DeferredNorm(h, h * gamma, sumsq, gamma, 1e-6)
    two = fused_moe(deferred, w13, w2, weights, ids, config=TINY)
    assert torch.equal(fused_moe(deferred, w13, w2, weights, ids, config=variant), two)
    normed = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * gamma
    assert rel_err(two, native_fused_moe(normed, w13, w2, weights, ids)) < tolerance(torch.float32)


def _down_launches(monkeypatch) -> list[tuple[int, bool]]:
    """Records each ``_down_kernel`` launch's (tokens, OVERLAP)."""
    import atom_kernels_triton.fused_moe as module

    seen, real = [], module._down_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                num_pairs, top_k = args[9], args[10]
                seen.append((num_pairs // top_k, kwargs["OVERLAP"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_down_kernel", Spy())
    return seen


def test_overlap_only_where_the_gate_up_grid_cannot_all_be_resident(monkeypatch):
    # Taken where the gate/up grid is past twice the programs the GPU holds (the interpreter
    # counts 1); refused, with the same output, where the whole grid fits: then the down
    # kernel could start before the alignment has finished.
    import atom_kernels_triton.fused_moe as module

    x, w13, w2, weights, ids = moe_inputs(7, 8, 3, 40, 24, torch.float32)
    want = fused_moe(x, w13, w2, weights, ids, config=TINY)
    seen = _down_launches(monkeypatch)
    assert torch.equal(fused_moe(x, w13, w2, weights, ids, config=OVERLAP), want)
    assert torch.equal(fused_moe(x, w13, w2, weights, ids, config=TINY), want)
    monkeypatch.setattr(module, "resident_programs", lambda *args, **kwargs: 10**6)
    assert torch.equal(fused_moe(x, w13, w2, weights, ids, config=OVERLAP), want)
    assert seen == [(7, True), (7, False), (7, False)]


@pytest.mark.parametrize("tokens", [3, 300])  # the decode kernel's path and the torch path
def test_alignment_zeroes_block_counts(tokens):
    ids = torch.randint(0, 6, (tokens, 2), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    capacity = aligned_capacity(ids.numel(), 6, 16)
    counts = torch.full((capacity // 16,), 7, dtype=torch.int32, device=DEVICE)
    align_by_expert(ids, 6, 16, 0, counts)
    assert not counts.any()


def test_occupancy_arithmetic():
    from atom_kernels_triton.occupancy import programs_per_sm

    # 64K registers an SM: 128 regs x 64 threads = 8K a block -> 8; 255 regs round to 256.
    assert programs_per_sm(128, 0, 2, 65536, 232448) == 8
    assert programs_per_sm(255, 0, 2, 65536, 232448) == 4
    # 60 KiB of shared memory (+1 KiB reserved) a block: 3 in 227 KiB.
    assert programs_per_sm(32, 60 * 1024, 2, 65536, 232448) == 3
    # 64 warps an SM at most; and a kernel that compiled fits at least once.
    assert programs_per_sm(16, 0, 8, 65536, 232448) == 8
    assert programs_per_sm(255, 300 * 1024, 4, 65536, 232448) == 1
    # sm89 holds 48 warps an SM, not 64.
    assert programs_per_sm(16, 0, 8, 65536, 232448, (8, 9)) == 6


def test_occupancy_keys_follow_triton_specializations():
    from atom_kernels_triton.occupancy import _specialization

    t = torch.zeros(64)
    assert _specialization(t) != _specialization(t[1:])  # 16-byte aligned or not
    assert _specialization(32) != _specialization(33) != _specialization(1)
    assert _specialization(48) == _specialization(64) != _specialization(2**33)
