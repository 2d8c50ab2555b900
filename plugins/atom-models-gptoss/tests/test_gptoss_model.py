"""Logits of ATOM's gpt-oss against transformers' on tiny random checkpoints (fp32, CPU):
unquantized, MXFP4 as shipped, and the checkpoint transformers writes once it has
dequantized the MXFP4 one. Steps mix whole prompts, a chunk over a cached prefix and
decodes, over contexts longer than the sliding window."""

from __future__ import annotations

import pytest
import torch
from atom_models_gptoss.moe import GptOssExperts
from tiny_gptoss import SLIDING_WINDOW, hf_model, tiny_dir

from atom_core.config import Config
from atom_core.layers.context import forward_context
from atom_core.loader import load_model
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches


def load(variant: str):
    return load_model(Config.from_kwargs(model=str(tiny_dir(variant))), "cpu", torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16", "mxfp4", "dequantized"])
def test_logits_match_transformers(variant):
    model, hf = load(variant).model, hf_model(variant)
    kv = PagedKV(num_blocks=64, block_size=4, seed=1)
    allocate_kv_caches(model, kv)
    g = torch.Generator().manual_seed(0)
    # Two prompts past the window; the last one is computed in two chunks.
    prompts = [torch.randint(0, 272, (n,), generator=g).tolist() for n in (5, 19, 3, 14)]
    ids = [kv.add_sequence() for _ in prompts]
    context: list[list[int]] = [[] for _ in prompts]
    worst = 0.0

    def step(new: list[list[int]]) -> list[int]:
        """Run one engine step of ``new`` tokens per sequence; each one's greedy next token."""
        nonlocal worst
        meta, positions = kv.step(ids, [len(t) for t in new])
        flat = torch.tensor([t for chunk in new for t in chunk])
        with torch.no_grad(), forward_context(meta):
            outs = model.compute_logits(model(flat, positions)).split([len(t) for t in new])
        for ctx, n, got in zip(context, new, outs):
            ctx.extend(n)
            with torch.no_grad():
                ref = hf(torch.tensor([ctx])).logits[0, -len(n):]
            worst = max(worst, (got - ref).abs().max().item())
        return [int(o[-1].argmax()) for o in outs]

    nxt = step([*prompts[:3], prompts[3][:6]])  # whole prompts and a first chunk
    nxt = step([[t] for t in nxt[:3]] + [prompts[3][6:]])  # decodes and the cached-prefix chunk
    step([[t] for t in nxt])  # decodes only
    assert max(len(c) for c in context) > 2 * SLIDING_WINDOW
    assert worst < 1e-4, f"{variant}: max |logits - transformers| = {worst}"


def test_experts_load_as_shipped():
    mx = load("mxfp4").model.model.layers[0].mlp.experts
    plain = load("dequantized").model.model.layers[0].mlp.experts
    assert isinstance(mx, GptOssExperts) and mx.mxfp4 and not plain.mxfp4
    assert mx.w13_weight.dtype == torch.uint8 and mx.w13_weight.shape == (4, 128, 32)
    assert mx.w2_weight_scale.shape == (4, 64, 2)
    # The dequantized checkpoint holds exactly the MXFP4 values, transposed to [E, N, K].
    from atom_core.quant.mxfp4 import dequantize

    assert torch.equal(dequantize(mx.w13_weight, mx.w13_weight_scale), plain.w13_weight)
    assert torch.equal(dequantize(mx.w2_weight, mx.w2_weight_scale), plain.w2_weight)


def test_layers_alternate_sliding_and_full_attention():
    model = load("bf16").model
    windows = [layer.self_attn.attn.backend.sliding_window for layer in model.model.layers]
    assert windows == [SLIDING_WINDOW, None]
    sinks = model.model.layers[0].self_attn.sinks
    assert model.model.layers[0].self_attn.attn.backend.sinks is sinks
    assert torch.equal(sinks, hf_model("bf16").model.layers[0].self_attn.sinks)
