"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

A sequence's ``block_table`` lists the physical blocks holding its KV, block ``i`` covering
tokens ``[i * block_size, (i + 1) * block_size)``. With prefix caching, every full block gets a
chained hash (its tokens plus the hash of the block before it), so two sequences sharing a
prompt prefix share the blocks of that prefix. Freed blocks keep their hash and can still be
hit until they are reused for something else.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence as Tokens

import xxhash

from atom_core.engine.sequence import Sequence


def hash_block_tokens(prev_hash: int | None, token_ids: Tokens[int]) -> int:
    """Chained hash of one full block: the same tokens after a different prefix hash differently."""
    h = xxhash.xxh3_64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    """One physical KV block. ``hash``/``token_ids`` are set only once it is full and computed."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] = []

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = None
        self.token_ids = []


class BlockManager:
    """Hands out KV blocks to sequences; shares full prompt-prefix blocks when caching is on.

    Free blocks (ref_count 0) sit in ``_free`` in eviction order: blocks with nothing worth
    keeping first, then cached blocks least recently freed first. Taking a free cached block
    as a prefix hit removes it from the queue; reusing it for other tokens drops its hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block_id, full computed blocks only
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found cached

    # ---- stats ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached-but-free count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def reset_prefix_cache_stats(self) -> None:
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- prefix matching -------------------------------------------------------------

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of cached blocks equal to seq's leading full blocks.

        At most ``(num_tokens - 1) // block_size`` blocks, so at least one token is left to
        compute (the step that samples) and that token's block is a fresh, private one.
        Stops at the first miss, so the cost is bounded by the hit length.
        """
        hits: list[int] = []
        prev: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            prev = hash_block_tokens(prev, tokens)
            block_id = self._cached.get(prev)
            # Comparing the tokens makes a colliding hash a miss, never wrong KV.
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def _uses_cache(self, seq: Sequence, use_prefix_cache: bool) -> bool:
        return self.enable_prefix_caching and use_prefix_cache and not seq.block_table

    def prefix_hit_tokens(self, seq: Sequence, use_prefix_cache: bool = True) -> int:
        """Tokens ``allocate`` would take from the cache for seq now (no side effects).

        Nonzero only for a sequence without blocks. The scheduler subtracts this from the
        tokens it has to compute before choosing ``num_new_tokens``.
        """
        if not self._uses_cache(seq, use_prefix_cache):
            return 0
        return len(self._match_prefix(seq)) * self.block_size

    # ---- allocation ---------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, use_prefix_cache: bool = True) -> bool:
        """Make seq's block table cover ``[0, num_computed_tokens + num_new_tokens)``.

        For a sequence without blocks (new, or preempted) and caching on, the cached prefix
        is taken first and ``seq.num_computed_tokens`` / ``num_cached_tokens`` are set to the
        hit tokens (``prefix_hit_tokens(seq)``); ``num_new_tokens`` counts tokens *after*
        the hits. Returns False and changes nothing when the free blocks do not suffice.
        """
        fresh = not seq.block_table
        if fresh:
            assert seq.num_computed_tokens == 0, "a sequence without blocks has nothing computed"
        use_cache = self._uses_cache(seq, use_prefix_cache)
        hits = self._match_prefix(seq) if use_cache else []
        num_computed = len(hits) * self.block_size if fresh else seq.num_computed_tokens
        end = num_computed + num_new_tokens
        num_needed = (end + self.block_size - 1) // self.block_size
        num_new_blocks = max(0, num_needed - len(seq.block_table) - len(hits))
        # Hit blocks that are free leave the free pool too.
        num_free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_free_hits > len(self._free):
            return False

        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table.extend(hits)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        if fresh:
            seq.num_computed_tokens = seq.num_cached_tokens = num_computed
            if use_cache:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_computed
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]  # evicted: its content is about to be overwritten
        block.reset()
        return block_id

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks that became full and computed since last time.

        A sequence's hashed blocks are always a prefix of its block table, so walking back
        from the last full block to the first hashed one finds exactly the new ones.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1
        prev = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = seq.block_tokens(i, self.block_size)
            block.hash = prev = hash_block_tokens(prev, block.token_ids)
            # A twin computed concurrently by another sequence may already be registered;
            # keep that one (this block still carries its hash for the chain).
            self._cached.setdefault(prev, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Release seq's block references (tail first, so tails are evicted first).

        Only the blocks: resetting ``num_computed_tokens`` is the scheduler's business.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None or self._cached.get(block.hash) != block_id:
                    # Not hittable: reuse it before any cached block.
                    block.hash = None
                    block.token_ids = []
                    self._free.move_to_end(block_id, last=False)
        seq.block_table.clear()
