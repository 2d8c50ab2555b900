"""Test-side stand-ins for the model runner: a paged block allocator that builds
AttentionMetadata, per-layer cache allocation, and the model-vs-transformers check that
the model plugins' tests share."""

from __future__ import annotations

import torch

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import forward_context


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
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
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


def check_against_transformers(
    kind: str, block_size: int = 4, tol: float = 1e-4, device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Load ``tiny_model_dir(kind)`` with load_model and run three engine steps against
    transformers' fp32 logits on the same tokens; returns the largest difference seen.

    step 1: three whole prompts and the first chunk of a fourth, one flat batch;
    step 2: a decode for each of the three, plus the fourth prompt's remaining chunk over
            its cached prefix (a mixed batch);
    step 3: a decode for all four (the decode-only path).
    """
    from atom_core.config import Config
    from atom_core.loader import load_model
    from tests.tiny_models import hf_model, tiny_model_dir

    loaded = load_model(Config.from_kwargs(model=str(tiny_model_dir(kind))), device, dtype)
    model, hf = loaded.model, hf_model(kind).to(device)
    kv = PagedKV(num_blocks=64, block_size=block_size, seed=1)
    allocate_kv_caches(model, kv, dtype, device)
    g = torch.Generator().manual_seed(0)
    vocab = loaded.hf_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 11, 3, 10)]
    ids = [kv.add_sequence() for _ in prompts]
    worst = 0.0

    def run(new: list[list[int]]) -> list[torch.Tensor]:
        meta, positions = kv.step(ids, [len(t) for t in new], device)
        flat = torch.tensor([t for chunk in new for t in chunk], dtype=torch.int64, device=device)
        with torch.no_grad(), forward_context(meta):
            logits = model.compute_logits(model(flat, positions))
        assert logits.dtype == torch.float32 and logits.shape == (len(flat), vocab)
        return list(logits.split([len(t) for t in new]))

    def compare(context: list[int], got: torch.Tensor) -> None:
        nonlocal worst
        with torch.no_grad():
            ref = hf(torch.tensor([context], device=device)).logits[0, -got.shape[0]:].float()
        diff = (got - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < tol, f"{kind}: max |logits - transformers| = {diff} at context {len(context)}"

    context = [list(p) for p in prompts[:3]] + [prompts[3][:6]]
    outs = run([list(c) for c in context])
    for ctx, got in zip(context, outs):
        compare(ctx, got)

    new = [[int(o[-1].argmax())] for o in outs[:3]] + [prompts[3][6:]]
    for ctx, n in zip(context, new):
        ctx.extend(n)
    outs = run(new)
    for ctx, got in zip(context, outs):
        compare(ctx, got)

    new = [[int(o[-1].argmax())] for o in outs]
    for ctx, n in zip(context, new):
        ctx.extend(n)
    outs = run(new)
    for ctx, got in zip(context, outs):
        compare(ctx, got)
    return worst
