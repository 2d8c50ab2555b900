"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A sequence with draft tokens x_0..x_{k-1} is verified by one target pass over k+1 rows:
row j holds the target distribution p_j for the position of x_j, and row k the position
after the last draft. Draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection a token is drawn from norm(max(0, p_j - q_j)) and the sequence
stops; if all k drafts are accepted, a bonus token is drawn from p_k. Every emitted token
is then distributed exactly as if drawn from the target alone.

Greedy sequences accept x_j iff it is the argmax of p_j and emit the argmax of the first
mismatching row (or of row k). Sampling uses the same exponential race as
``atom_core.layers.sampler`` (``argmax(probs / Exponential(1))``), so nothing syncs with
the host and a seeded sequence takes all its randomness from its own generator: its
tokens depend only on its seed and inputs, not on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from atom_core.layers.transfer import host_to_device


@dataclass
class RejectionOutput:
    """Per-sequence result of verifying one batch, S sequences, K = max draft length.

    ``token_ids[s, :num_tokens[s]]`` are the emitted tokens: the accepted drafts followed
    by one corrected or bonus token; the rest of the row is -1. ``logprobs`` holds log p
    of each emitted token under the target row that produced it (-inf at padding).
    """

    token_ids: Tensor  # [S, K+1] long, -1 padded
    num_tokens: Tensor  # [S] long, num_accepted + 1
    num_accepted: Tensor  # [S] long, 0..k_s
    logprobs: Tensor  # [S, K+1] fp32, -inf padded


def _layout(num_draft_tokens: Sequence[int], width: int) -> tuple[list[list[int]], list[list[int]]]:
    """Host-side index maps into the flat inputs: for each sequence and position j in
    0..width, the target row (clamped past k_s) and the draft row (for j < width, clamped).
    Clamped entries are valid indices whose results are masked out."""
    last_draft = sum(num_draft_tokens) - 1
    target_rows, draft_rows = [], []
    t_start = d_start = 0
    for k in num_draft_tokens:
        target_rows.append([t_start + min(j, k) for j in range(width + 1)])
        draft_rows.append([min(d_start + min(j, max(k - 1, 0)), last_draft) for j in range(width)])
        t_start += k + 1
        d_start += k
    return target_rows, draft_rows


def check_inputs(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: Tensor | None,
    greedy: Sequence[bool] | None,
    generators: Sequence[torch.Generator | None] | None,
) -> tuple[list[bool], list[torch.Generator | None]]:
    """Raise ValueError on inconsistent shapes; return ``greedy`` and ``generators`` with one
    entry per sequence (``rejection_sample`` says what each argument holds)."""
    num_seqs = len(num_draft_tokens)
    num_drafts = sum(num_draft_tokens)
    rows, vocab = target_probs.shape
    if rows != num_drafts + num_seqs:
        raise ValueError(f"target_probs has {rows} rows, expected {num_drafts + num_seqs}")
    if draft_token_ids.shape != (num_drafts,):
        raise ValueError(
            f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, expected ({num_drafts},)"
        )
    if draft_probs is not None and draft_probs.shape != (num_drafts, vocab):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected ({num_drafts}, {vocab})"
        )
    greedy = list(greedy) if greedy is not None else [False] * num_seqs
    generators = list(generators) if generators is not None else [None] * num_seqs
    if len(greedy) != num_seqs or len(generators) != num_seqs:
        raise ValueError("greedy and generators need one entry per sequence")
    return greedy, generators


def draw_random(
    num_draft_tokens: Sequence[int],
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
    vocab: int,
    device: torch.device,
) -> tuple[Tensor, Tensor | None]:
    """All the randomness of one verification: uniforms [S, K] fp32 for acceptance and
    exponential noise [S, V] fp32 for the final token (None when every sequence is greedy).

    Unseeded rows come from the global generator; a seeded sampled sequence then overwrites
    its k_s uniforms and its noise row from its own generator, in sequence order. Every
    implementation of the op draws through here, so a seeded request gets the same tokens
    from each of them.
    """
    num_seqs = len(num_draft_tokens)
    width = max(num_draft_tokens, default=0)
    uniforms = torch.rand(num_seqs, width, device=device)
    all_greedy = any(greedy) and all(greedy)
    noise = None if all_greedy else torch.empty(num_seqs, vocab, device=device).exponential_()
    for s, gen in enumerate(generators):
        if gen is None or greedy[s]:
            continue
        ks = num_draft_tokens[s]
        uniforms[s, :ks] = torch.rand(ks, device=device, generator=gen)
        noise[s] = torch.empty(vocab, device=device).exponential_(generator=gen)
    return uniforms, noise


def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: Tensor | None = None,
    greedy: Sequence[bool] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> RejectionOutput:
    """Verify the drafts of S sequences against the target in one vectorised pass.

    Args:
        target_probs: [N, V] fp32, N = sum(k_s + 1): the target's processed probabilities
            (temperature, top-k/top-p already applied), sequence by sequence, k_s + 1 rows
            each (row j scores draft j; the last row gives the bonus token).
        draft_token_ids: [D] long, D = sum(k_s): the drafts, sequence by sequence.
        num_draft_tokens: k_s per sequence (host ints, 0 allowed: a plain decode row).
        draft_probs: [D, V] the draft's probabilities for each draft position, or None for
            a deterministic draft (n-gram lookup), where q is one-hot on the draft token.
        greedy: per sequence, True for temperature 0 (argmax verification); None = none.
        generators: per sequence, its own generator (on ``target_probs``' device) or None.
            A seeded sequence draws k_s uniforms then V exponentials from it every call;
            greedy sequences draw nothing.

    Returns:
        RejectionOutput with [S, K+1] tokens and logprobs, K = max(k_s).
    """
    greedy, generators = check_inputs(
        target_probs, draft_token_ids, num_draft_tokens, draft_probs, greedy, generators
    )
    num_seqs = len(num_draft_tokens)
    num_drafts = sum(num_draft_tokens)
    vocab = target_probs.shape[1]
    any_greedy = any(greedy)
    all_greedy = any_greedy and all(greedy)
    device = target_probs.device

    width = max(num_draft_tokens, default=0)
    target_rows_list, draft_rows_list = _layout(num_draft_tokens, width)
    # Explicit shapes: torch.tensor of empty rows cannot tell [S, 0] from [0].
    target_rows = host_to_device(target_rows_list, torch.long, device).reshape(num_seqs, width + 1)
    draft_rows = host_to_device(draft_rows_list, torch.long, device).reshape(num_seqs, width)
    k = host_to_device(list(num_draft_tokens), torch.long, device)
    greedy_t = host_to_device(greedy, torch.bool, device)
    pos = torch.arange(width + 1, device=device)
    has_draft = pos[:width] < k[:, None]  # [S, K]

    drafts = draft_token_ids.long()[draft_rows] if num_drafts else draft_rows  # [S, K]
    draft_target_rows = target_rows[:, :width]
    target_argmax = target_probs.argmax(dim=-1) if any_greedy else None  # [N]
    uniforms, noise = draw_random(num_draft_tokens, greedy, generators, vocab, device)

    # Acceptance: u < p/q written as u * q < p, so q = 0 cannot divide and p = 0 rejects.
    p_draft = target_probs[draft_target_rows, drafts]
    if draft_probs is None:
        accept = uniforms < p_draft
    else:
        accept = uniforms * draft_probs[draft_rows, drafts] < p_draft
    if any_greedy:
        greedy_accept = drafts == target_argmax[draft_target_rows]
        accept = torch.where(greedy_t[:, None], greedy_accept, accept)
    accept &= has_draft
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [S]
    final_rows = target_rows.gather(1, num_accepted[:, None])[:, 0]  # [S]

    if all_greedy:
        final = target_argmax[final_rows]
    else:
        final_probs = target_probs[final_rows]  # [S, V]
        residual = final_probs
        if num_drafts:
            rejected = num_accepted < k
            at = num_accepted.clamp_max(width - 1)[:, None]
            rejected_token = drafts.gather(1, at)
            if draft_probs is None:
                # One-hot q: max(0, p - q) is p without the rejected token's mass.
                residual = final_probs.scatter(1, rejected_token, 0.0)
            else:
                q = draft_probs[draft_rows.gather(1, at)[:, 0]]
                residual = (final_probs - q).clamp_min_(0.0)
            # Rounding can leave nothing (p <= q everywhere): sample from p instead.
            empty = residual.sum(dim=-1, keepdim=True) <= torch.finfo(residual.dtype).tiny
            residual = torch.where(rejected[:, None] & ~empty, residual, final_probs)
        # The race is invariant to scaling a row, so the residual needs no normalising;
        # an exact 0 draw would give 0/0 = nan for masked tokens, hence the clamp.
        final = (residual / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        if any_greedy:
            final = torch.where(greedy_t, target_argmax[final_rows], final)

    padded_drafts = torch.cat([drafts, drafts.new_zeros(num_seqs, 1)], dim=1)
    emitted = pos <= num_accepted[:, None]  # [S, K+1]
    token_ids = torch.where(pos < num_accepted[:, None], padded_drafts, -1)
    token_ids.scatter_(1, num_accepted[:, None], final[:, None])
    token_probs = target_probs[target_rows, token_ids.clamp_min(0)]
    logprobs = torch.where(emitted, token_probs.float().log(), float("-inf"))
    return RejectionOutput(
        token_ids=token_ids,
        num_tokens=num_accepted + 1,
        num_accepted=num_accepted,
        logprobs=logprobs,
    )
