"""A model plugin's logits against transformers' on the same tiny random checkpoint: the
check every model family's tests run (fp32 by default, any device)."""

from __future__ import annotations

import torch

from atom_core.config import Config
from atom_core.layers.context import forward_context
from atom_core.loader import load_model
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches
from atom_core.testing.tiny_models import hf_model, tiny_model_dir


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
