"""``--calculate-kv-scales``: each layer's fp8 KV-cache scales measured at start-up.

An e4m3 cache holds ``x / scale``. With the default scale of 1.0, values under 2^-6 are
subnormal and keep few bits, and a model whose K or V are small loses most of their
precision; a checkpoint's ``k_scale``/``v_scale`` fix that, and most checkpoints have none.
This measures them: before the runner captures its graphs (the scales are kernel arguments,
fixed from then on), the model reads a fixed English text into a cache of its own dtype,
all of it (up to the model length) in chunks of the token budget, and each layer's K (V)
scale becomes the one, of a few from the largest value it wrote over 448 (the finest that
clips nothing) to that over 8, whose e4m3 round trip of those values has the least squared
error. A finer scale keeps more small values above e4m3's coarse subnormals (under 2^-6 of
the scale); a coarser one leaves headroom for prompts whose values run larger than the
text's. vLLM's ``--calculate-kv-scales`` takes the largest value over 200 (K) and over 100
(V); on the embedded SmolLM2, when calibration read only the text's first 32 tokens, that
cost +1.85% perplexity against -0.07% for the least error (the least error, from the whole
text, scores -2.0%: ``tests/engine/test_fp8_kv_cache.py``). Layers whose checkpoint has
scales keep those.

A draft network beside the target (``--method draft_model``, ``mtp``, ``eagle3``) writes a
cache of its own through the same blocks; it reads the same text as it does in serving
(engine/drafter.py) and its layers' scales are measured the same way: a draft cache left
at 1.0 beside a calibrated target's loses precision the target's keeps, and its drafts
are accepted less often.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from atom_core.engine.step_inputs import eager_inputs
from atom_core.layers.attention.mla import MLAAttention
from atom_core.layers.context import forward_context
from atom_core.spec_decode.proposer import DraftNetwork

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
# Where the candidate scales put the largest calibration value: 448, the finest scale that
# clips none of them, down to 8 (the most headroom).
TARGETS = (448.0, 300.0, 200.0, 150.0, 100.0, 64.0, 32.0, 16.0, 8.0)

# Jane Austen, "Pride and Prejudice" (1813), chapter I: public domain. Not the text the
# perplexity tests score (tests/perplexity.py), so they do not grade the calibration data.
CALIBRATION_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered as the rightful property of "
    "some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him one "
    "day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he "
    "had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me "
    "all about it.\" Mr. Bennet made no answer. \"Do not you want to know who has taken it?\" "
    "cried his wife impatiently. \"You want to tell me, and I have no objection to hearing "
    "it.\" This was invitation enough."
)


def calibration_ids(tokenizer: Any, max_tokens: int) -> list[int]:
    """The calibration text's token ids, at most ``max_tokens`` of them."""
    ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
    return list(ids)[:max_tokens]


def least_error_scale(x: torch.Tensor) -> float:
    """Of the scales amax / t (t in TARGETS), the one whose e4m3 round trip of ``x`` has the
    least squared error; 1.0 where ``x`` is all zeros."""
    x = x.float().flatten()
    amax = float(x.abs().amax())
    if amax == 0:
        return 1.0
    errors = {}
    for target in TARGETS:
        scale = amax / target
        back = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
        errors[scale] = float((back - x).square().sum())
    return min(errors, key=errors.__getitem__)


@torch.inference_mode()
def calculate_kv_scales(model: torch.nn.Module, layers: list, ids: list[int], block_size: int,
                        dtype: torch.dtype, device: torch.device,
                        draft: DraftNetwork | None = None, chunk: int | None = None) -> str:
    """Set the scales of ``layers`` (the model's KV layers), and of ``draft``'s where one runs
    beside it, without checkpoint scales from an eager prefill of ``ids`` into caches of
    ``dtype``, freed after; the line to log. ``chunk``: the most tokens one forward reads
    (None: all of them), as the scheduler chunks a prompt; the scales come from every token
    whatever the chunk, so a small token budget does not measure them on fewer."""
    n = len(ids)
    blocks = -(-n // block_size)
    table = list(range(blocks))
    draft_layers = draft.attention_layers() if draft is not None else []
    for layer in layers + draft_layers:
        layer.kv_cache = torch.zeros(layer.kv_cache_shape(blocks, block_size), dtype=dtype,
                                     device=device)
    step = chunk or n
    keep = draft is not None and draft.reads_target_hidden

    def target(input_ids: torch.Tensor, positions: torch.Tensor, rows: slice) -> Any:
        hidden = model(input_ids, positions)
        return draft.target_hidden(hidden) if keep else None  # each chunk's, as it is read

    states = _chunked_prefill(target, ids, table, block_size, step, device)
    if draft is not None:
        _draft_prefill(draft, ids, torch.cat(states) if keep else None, table, block_size,
                       step, device)
    line = "--calculate-kv-scales: " + _measure(layers, n)
    if draft_layers:
        line += "; the draft's " + _measure(draft_layers, n)
    return line


def _draft_prefill(draft: DraftNetwork, ids: list[int], states: torch.Tensor | None,
                   table: list[int], block_size: int, step: int, device: torch.device) -> None:
    """``draft`` over the calibration text as it reads a prompt beside the target, ``step``
    tokens a forward: a network reading the target's hidden states (``states``, the
    target's rows through ``target_hidden``) sees token p + 1 and the target's state at p,
    a draft model token p (engine/drafter.py)."""
    if draft.reads_target_hidden:
        tokens, states = ids[1:], states[: len(ids) - 1]
    else:
        tokens, states = ids, None
    _chunked_prefill(
        lambda input_ids, positions, rows: draft.forward(
            input_ids, positions, None if states is None else states[rows]),
        tokens, table, block_size, step, device)


def _chunked_prefill(forward: Callable[[torch.Tensor, torch.Tensor, slice], Any],
                     tokens: list[int], table: list[int], block_size: int, step: int,
                     device: torch.device) -> list[Any]:
    """``tokens`` read as one prompt in chunks of ``step``, as the scheduler chunks it:
    ``forward(input_ids, positions, rows)`` per chunk (``rows``: the chunk's slice of the
    prompt); what each call returned."""
    outs = []
    for start in range(0, len(tokens), step):
        count = min(step, len(tokens) - start)
        inputs = eager_inputs([tokens], [start], [count], [table], block_size, device)
        with forward_context(inputs.meta):
            outs.append(forward(inputs.input_ids, inputs.positions, slice(start, start + count)))
    return outs


def _measure(layers: list, n: int) -> str:
    """Each layer's scales from the cache it just wrote (then freed); what was set."""
    measured = []
    for layer in layers:
        cache, layer.kv_cache = layer.kv_cache, None
        if layer.kv_scales_from_checkpoint:
            continue
        if isinstance(layer, MLAAttention):  # one latent cache, one scale
            layer.set_kv_scales(least_error_scale(cache))
        else:
            layer.set_kv_scales(least_error_scale(cache[0]), least_error_scale(cache[1]))
        measured.extend(layer.kv_scales)
    if not measured:
        return "every layer has its checkpoint's scales"
    kept = sum(layer.kv_scales_from_checkpoint for layer in layers)
    return (f"{len(layers) - kept} layers' fp8 KV scales from {n} calibration tokens "
            f"({min(measured):.4g} to {max(measured):.4g})"
            + (f", {kept} from the checkpoint" if kept else ""))
