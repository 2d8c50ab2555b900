"""BlockManager: accounting, reference counts, chained prefix hashes, LRU eviction."""

from __future__ import annotations

import random

import pytest

from atom_core.engine import block_manager as bm_module
from atom_core.engine.block_manager import BlockManager, hash_block_tokens
from atom_core.engine.sequence import Sequence
from atom_core.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Allocate and 'run' n (default: all remaining) tokens of seq, as an engine step would."""
    if n is None:  # prefix hits (only for a sequence without blocks) are not computed
        n = seq.num_uncomputed_tokens - bm.prefix_hit_tokens(seq)
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.commit_full_blocks(seq)


def assert_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
    assert refs == [b.ref_count for b in bm.blocks]
    assert bm.num_free_blocks == refs.count(0)


def test_allocate_and_free_accounting():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    seq.num_computed_tokens = 10
    for _ in range(2):  # decodes up to 12 tokens stay within block 3
        seq.append_token(0)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
    assert len(seq.block_table) == 3
    seq.append_token(0)  # token 13 needs a 4th block
    assert bm.allocate(seq, 1)
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0
    assert seq.num_computed_tokens == 12  # free releases blocks only
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_shared_prefix_shares_blocks_with_ref_counts():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = make_seq(list(range(10)))
    compute(bm, a)
    b = make_seq(list(range(8)) + [100, 101, 102])
    assert bm.prefix_hit_tokens(b) == 8
    assert bm.num_free_blocks == 5  # prefix_hit_tokens has no side effects
    assert bm.allocate(b, 3)  # num_new_tokens counts tokens after the hits
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 4
    assert_consistent(bm, [a, b])
    assert bm.prefix_cache_queries == 10 + 11 and bm.prefix_cache_hits == 8
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 21)
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_hit_always_leaves_a_token_to_compute():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    compute(bm, make_seq(list(range(9))))
    # Same 8 tokens: both blocks are cached, but only one may be hit.
    assert bm.prefix_hit_tokens(make_seq(list(range(8)))) == 4
    assert bm.prefix_hit_tokens(make_seq(list(range(9)))) == 8
    assert bm.prefix_hit_tokens(make_seq(list(range(4)))) == 0


def test_no_hit_without_prefix_caching_or_when_disabled_per_call():
    tokens = list(range(12))
    off = BlockManager(8, BS, enable_prefix_caching=False)
    compute(off, make_seq(tokens))
    assert off.prefix_hit_tokens(make_seq(tokens)) == 0
    on = BlockManager(8, BS, enable_prefix_caching=True)
    compute(on, make_seq(tokens))
    seq = make_seq(tokens)
    assert on.prefix_hit_tokens(seq, use_prefix_cache=False) == 0
    queries = on.prefix_cache_queries
    assert on.allocate(seq, 12, use_prefix_cache=False)
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert len(set(seq.block_table)) == 3 and on.prefix_cache_queries == queries


def test_hash_is_chained_so_position_matters():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    compute(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block [5,6,7,8] is cached, but only after [1,2,3,4].
    assert bm.prefix_hit_tokens(make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9])) == 0
    assert bm.prefix_hit_tokens(make_seq([5, 6, 7, 8, 9])) == 0
    assert bm.prefix_hit_tokens(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == 8
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) == hash_block_tokens(h0, (5, 6, 7, 8))


def test_hash_collision_is_rejected_by_token_comparison(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda prev, tokens: 42)
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    b = make_seq([5, 6, 7, 8, 9])  # same (forced) hash, other tokens
    assert bm.prefix_hit_tokens(b) == 0
    assert bm.allocate(b, 5)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert bm.prefix_hit_tokens(make_seq([1, 2, 3, 4, 7])) == 4  # real match still hits


def test_lru_eviction_keeps_most_recently_freed_hittable():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    seqs = [make_seq([k] * 8) for k in (1, 2, 3)]
    for seq in seqs:
        compute(bm, seq)
    assert bm.num_free_blocks == 0
    for seq in seqs:  # free A, then B, then C
        bm.free(seq)
    assert bm.num_free_blocks == 6

    def hits(k: int) -> int:
        return bm.prefix_hit_tokens(make_seq([k] * 8 + [0]))

    assert [hits(k) for k in (1, 2, 3)] == [8, 8, 8]
    d = make_seq([7] * 3)
    assert bm.allocate(d, 3)  # one block: A's tail (freed first, least recent) is reused
    assert [hits(k) for k in (1, 2, 3)] == [4, 8, 8]
    e = make_seq([8] * 7)
    assert bm.allocate(e, 7)  # two more: A's head, then B's tail
    assert [hits(k) for k in (1, 2, 3)] == [0, 4, 8]
    assert_consistent(bm, [d, e])


def test_uncached_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a, b = make_seq(list(range(8))), make_seq([50, 51])
    compute(bm, a)
    compute(bm, b)  # b's only block is partial: never hittable
    bm.free(a)
    bm.free(b)  # freed last, yet reused first
    assert bm.allocate(make_seq([60]), 1)
    assert bm.prefix_hit_tokens(make_seq(list(range(8)) + [0])) == 8


def test_reused_block_loses_its_old_hash():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    a_table = list(a.block_table)
    bm.free(a)  # eviction order: a's partial block, then [5..8], then [1..4]
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8])
    compute(bm, b)  # reuses the [5..8] block for the same tokens after another prefix
    assert b.block_table == [a_table[2], a_table[1]]
    # [1..4] is still cached, but its old successor now holds KV for prefix [9,9,9,9].
    assert bm.prefix_hit_tokens(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == 4
    assert bm.prefix_hit_tokens(make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])) == 8


def test_hit_on_free_cached_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = make_seq(list(range(8)))
    compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq(list(range(8)) + [50])
    assert bm.allocate(b, 1)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == cached_block_ids(bm, list(range(8)))
    assert bm.num_free_blocks == 1
    c = make_seq([60] * 5)  # needs 2 blocks, only one is free: the hit ones are not evictable
    assert not bm.allocate(c, 5)
    assert_consistent(bm, [b])


def cached_block_ids(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Block ids cached for the full blocks of tokens."""
    out, prev = [], None
    for i in range(len(tokens) // BS):
        prev = hash_block_tokens(prev, tokens[i * BS : (i + 1) * BS])
        out.append(bm._cached[prev])
    return out


def test_allocation_failure_changes_nothing():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = make_seq(list(range(9)))
    compute(bm, a)
    bm.free(a)
    before = [(b.ref_count, b.hash) for b in bm.blocks]
    stats = (bm.prefix_cache_queries, bm.prefix_cache_hits)
    big = make_seq(list(range(8)) + [0] * 12)  # 2 hit blocks + 3 fresh > 4 blocks
    assert bm.prefix_hit_tokens(big) == 8
    assert not bm.allocate(big, 12)
    assert big.block_table == [] and big.num_computed_tokens == 0 and big.num_cached_tokens == 0
    assert [(b.ref_count, b.hash) for b in bm.blocks] == before
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == stats
    assert bm.num_free_blocks == 4 and bm.prefix_hit_tokens(big) == 8
    # A running sequence asking for more than is free keeps its table as it was.
    run = make_seq(list(range(100, 108)))
    compute(bm, run)
    table = list(run.block_table)
    run.token_ids += [0] * 12
    assert not bm.allocate(run, 12)
    assert run.block_table == table and bm.num_free_blocks == 2


def test_commit_registers_decoded_blocks_incrementally():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3])
    compute(bm, seq)
    for t in range(4, 12):  # decode one token at a time
        seq.append_token(t)
        compute(bm, seq, 1)
    assert seq.num_computed_tokens == 11
    # Blocks filled by decoding hash exactly like a prompt of the same tokens.
    assert bm.prefix_hit_tokens(make_seq(list(range(1, 12)) + [0])) == 8
    assert [bm.blocks[b].token_ids for b in seq.block_table[:2]] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert bm.blocks[seq.block_table[2]].hash is None  # partial block: not cached


def test_twin_blocks_computed_concurrently_are_both_safe():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # neither cached yet: no sharing
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.commit_full_blocks(s)
    bm.free(a)
    assert bm.prefix_hit_tokens(make_seq(list(range(9)))) == 8
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.prefix_hit_tokens(make_seq(list(range(9)))) == 8


def test_random_workload_returns_every_block():
    rng = random.Random(0)
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    live: list[Sequence] = []
    for _ in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 4):
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        elif live and rng.random() < 0.5:
            seq = rng.choice(live)
            seq.append_token(rng.randrange(5))
            if bm.allocate(seq, seq.num_uncomputed_tokens):
                seq.num_computed_tokens = seq.num_tokens
                bm.commit_full_blocks(seq)
            else:
                seq.token_ids.pop()
        else:
            prefix = rng.choice(prefixes)
            seq = make_seq(prefix + [rng.randrange(5) for _ in range(rng.randrange(1, 6))])
            hit = bm.prefix_hit_tokens(seq)
            if bm.allocate(seq, seq.num_tokens - hit):
                assert seq.num_computed_tokens == hit
                seq.num_computed_tokens = seq.num_tokens
                bm.commit_full_blocks(seq)
                live.append(seq)
        assert_consistent(bm, live)
        for seq in live:  # every block a sequence holds has its tokens, if cached
            for i, b in enumerate(seq.block_table):
                if bm.blocks[b].hash is not None:
                    assert bm.blocks[b].token_ids == seq.block_tokens(i, BS)
    assert bm.prefix_cache_hits > 0
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)
