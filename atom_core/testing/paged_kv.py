"""Stand-ins for the model runner, for tests that drive a model directly: a paged block
allocator that builds AttentionMetadata, and per-layer KV cache allocation."""

from __future__ import annotations

import torch

from atom_core.layers.attention.metadata import AttentionMetadata


class PagedKV:
    """Sequences over a pool of blocks handed out in shuffled order, so block tables are
    never contiguous runs."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = torch.randperm(num_blocks, generator=g).tolist()
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.lens) - 1

    def step(
        self, seq_ids: list[int], query_lens: list[int], device: str | torch.device = "cpu"
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Append ``query_lens[i]`` tokens to sequence ``seq_ids[i]``: (metadata, positions)."""
        slots, positions, starts, seq_lens = [], [], [0], []
        for sid, qlen in zip(seq_ids, query_lens):
            old, new = self.lens[sid], self.lens[sid] + qlen
            table = self.tables[sid]
            while len(table) * self.block_size < new:
                table.append(self.free.pop())
            for pos in range(old, new):
                block, offset = divmod(pos, self.block_size)
                slots.append(table[block] * self.block_size + offset)
                positions.append(pos)
            self.lens[sid] = new
            starts.append(starts[-1] + qlen)
            seq_lens.append(new)
        width = max(len(self.tables[s]) for s in seq_ids) + 1  # one extra padding column
        tables = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, sid in enumerate(seq_ids):
            tables[row, : len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            block_size=self.block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def allocate_kv_caches(
    model: torch.nn.Module, kv: PagedKV, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """What the model runner does: one cache per attention layer, assigned to it. NaN-filled,
    so a read of a slot nobody wrote shows up in the results."""
    caches = []
    for layer in model.attention_layers():
        shape = layer.kv_cache_shape(kv.num_blocks, kv.block_size)
        layer.kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        caches.append(layer.kv_cache)
    return caches
