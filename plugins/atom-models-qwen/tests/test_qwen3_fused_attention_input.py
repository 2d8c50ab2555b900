"""Qwen3's attention input through qk_norm_rope_cache_write (norms + RoPE + K/V cache write
in one op) gives the same logits and caches, bit for bit, as the norm and rotary ops with
attention's own cache write (the backend's two default paths; CPU, fp32)."""

from __future__ import annotations

import torch
from atom_models_qwen.model import Qwen3Attention

from atom_core.config import Config
from atom_core.layers.attention import backend as attention_backend
from atom_core.layers.context import forward_context
from atom_core.loader import load_model
from atom_core.ops import resolve_op
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches
from atom_core.testing.tiny_models import tiny_model_dir


def run_steps(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A prefill batch, a mixed decode + chunk-over-cached-prefix batch, then decodes."""
    kv = PagedKV(num_blocks=32, block_size=4, seed=1)
    caches = allocate_kv_caches(model, kv)
    ids = [kv.add_sequence() for _ in range(2)]
    logits = []
    for lens, tokens in (([5, 3], range(8)), ([1, 4], range(8, 13)), ([1, 1], range(13, 15))):
        meta, positions = kv.step(ids, lens)
        flat = torch.tensor(list(tokens), dtype=torch.int64)
        with torch.no_grad(), forward_context(meta):
            logits.append(model.compute_logits(model(flat, positions)))
    return logits, caches


def test_fused_matches_unfused_path(monkeypatch):
    model = load_model(
        Config.from_kwargs(model=str(tiny_model_dir("qwen3"))), "cpu", torch.float32
    ).model
    attns = [m.attn for m in model.modules() if isinstance(m, Qwen3Attention)]
    assert attns and all(a.accepts_written_cache for a in attns)  # the native backend
    calls = []

    def counting(name, device):
        op = resolve_op(name, device)
        if name != "qk_norm_rope_cache_write":
            return op
        return lambda *args: calls.append(1) or op(*args)

    monkeypatch.setattr(attention_backend, "resolve_op", counting)
    fused_logits, fused_caches = run_steps(model)
    assert len(calls) == 3 * len(attns)  # the one op, every layer of every step
    for a in attns:  # as a backend with its own cache layout: the norm and rotary ops
        a.backend.accepts_written_cache = False
    logits, caches = run_steps(model)
    assert len(calls) == 3 * len(attns)
    for a, b in zip(fused_logits, logits):
        assert torch.equal(a, b)
    for a, b in zip(fused_caches, caches):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
