"""NgramProposer: which earlier occurrence is copied, truncation, and speed on long contexts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from atom_core.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Plain-Python statement of the rule the proposer vectorises."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_defaults_follow_vllm() -> None:
    proposer = NgramProposer()
    assert (proposer.min_n, proposer.max_n) == (5, 5)
    seq = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4, 5]
    assert proposer.propose([seq], 3) == [[6, 7, 9]]
    # Only a 4-token match: below the default minimum.
    assert proposer.propose([[2, 3, 4, 5, 6, 9, 2, 3, 4, 5]], 3) == [[]]


def test_latest_occurrence_wins() -> None:
    proposer = NgramProposer(min_n=1, max_n=2)
    seq = [7, 8, 10, 11, 7, 8, 20, 21, 0, 7, 8]
    assert proposer.propose([seq], 2) == [[20, 21]]


def test_longer_ngram_preferred_over_more_recent_shorter() -> None:
    proposer = NgramProposer(min_n=1, max_n=4)
    # [1, 2, 3] matches early; a later bare 3 matches only as a 1-gram.
    seq = [1, 2, 3, 40, 41, 3, 50, 51, 1, 2, 3]
    assert proposer.propose([seq], 2) == [[40, 41]]
    assert NgramProposer(min_n=1, max_n=1).propose([seq], 2) == [[50, 51]]


def test_no_match_proposes_nothing() -> None:
    proposer = NgramProposer(min_n=1, max_n=4)
    assert proposer.propose([[1, 2, 3, 4, 5]], 3) == [[]]
    assert NgramProposer(min_n=2, max_n=3).propose([[1, 2, 9, 2]], 3) == [[]]


def test_truncated_at_sequence_end_and_k_respected() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    seq = [5, 6, 7, 8, 9, 5, 6]
    assert proposer.propose([seq], 10) == [[7, 8, 9, 5, 6]]
    assert proposer.propose([seq], 2) == [[7, 8]]
    assert proposer.propose([seq], 0) == [[]]
    # A repeated token: the latest earlier occurrence is the one just before the tail.
    assert proposer.propose([[4, 4, 4, 4]], 3) == [[4]]


def test_batch_keeps_order_and_handles_empty_and_short() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    seqs = [[], [1], [1, 1], [3, 4, 5, 3, 4], [1, 2, 3]]
    assert proposer.propose(seqs, 4) == [[], [], [], [5, 3, 4], []]
    assert proposer.propose([], 4) == []


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=0, max_n=2)
    with pytest.raises(ValueError, match="max_n=2 < min_n=3"):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="k must be"):
        NgramProposer().propose([[1, 2]], -1)


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_matches_reference_on_random_sequences(min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(min_n * 10 + max_n)
    proposer = NgramProposer(min_n=min_n, max_n=max_n)
    for _ in range(300):
        # A small vocabulary makes matches of every length common.
        seq = rng.integers(0, 4, size=int(rng.integers(0, 40))).tolist()
        k = int(rng.integers(0, 6))
        assert proposer.propose([seq], k) == [reference(seq, k, min_n, max_n)], seq


def test_long_random_sequence_is_fast() -> None:
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 32_000, size=32_768).tolist()
    # Plant a 4-gram tail whose earlier copy is near the start, so the whole range is scanned.
    seq[100:108] = [1, 2, 3, 4, 11, 12, 13, 14]
    seq[-4:] = [1, 2, 3, 4]
    proposer = NgramProposer(min_n=1, max_n=4)
    assert proposer.propose([seq], 4) == [[11, 12, 13, 14]]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        proposer.propose([seq], 4)
        best = min(best, time.perf_counter() - start)
    assert best < 0.05
