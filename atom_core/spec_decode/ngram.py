"""N-gram (prompt lookup) proposer: drafts copied from earlier in the sequence, no weights."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# vLLM's defaults when neither prompt_lookup_min nor prompt_lookup_max is given.
DEFAULT_MIN_N = 5
DEFAULT_MAX_N = 5


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's tail.

    The tail tried is the last n tokens for n from ``max_n`` down to ``min_n`` (longer
    matches predict better); the first n with an earlier occurrence wins, and among its
    occurrences the most recent. Defaults follow vLLM (min = max = 5).
    """

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n, got max_n={max_n} < min_n={min_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids_per_seq: list[list[int]], k: int) -> list[list[int]]:
        """Up to k draft tokens per sequence: fewer at the sequence end, none without a match."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return [self.propose_one(ids, k) for ids in token_ids_per_seq]

    def propose_one(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        end = self._match_end(tokens)
        if end is None or k <= 0:
            return []
        return tokens[end + 1 : end + 1 + k].tolist()

    def _match_end(self, tokens: np.ndarray) -> int | None:
        """Index of the last token of the chosen earlier occurrence, or None."""
        total = len(tokens)
        # The tail itself is excluded, so an occurrence ends at most at total - 2.
        max_n = min(self.max_n, total - 1)
        if max_n < self.min_n:
            return None
        history = tokens[:-1]
        # matches[p]: the last n tokens also end at p. Grown one n at a time, so the whole
        # search costs O(total * max_n) vectorised work.
        matches = history == tokens[-1]
        best = None
        for n in range(1, max_n + 1):
            if n > 1:
                matches[: n - 1] = False
                matches[n - 1 :] &= history[: total - n] == tokens[total - n]
            hits = np.flatnonzero(matches)
            if len(hits) == 0:
                break
            if n >= self.min_n:
                best = int(hits[-1])
        return best
