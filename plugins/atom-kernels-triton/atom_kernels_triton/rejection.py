"""Rejection sampling for speculative decoding in one kernel: the ``rejection_sample`` op.

The torch reference (``atom_core.spec_decode.rejection``) spends a few dozen small kernels
on a verification; here one program per sequence walks its drafts, stops at the first
rejection and races the final token over the vocabulary in blocks. The randomness is drawn
in torch by the reference's own ``draw_random``, so a seeded request gets the same tokens
from both; every comparison, difference and quotient is the reference's, in fp32 and
correctly rounded (``div_rn``), so the results are equal, not merely close.

Each argmax keeps a per-lane (first maximum, its index) across the blocks and reduces the
lanes once at the end: the lowest index among equal maxima wins and a NaN counts as larger
than every number, as in ``torch.argmax``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from atom_core.layers.transfer import host_to_device
from atom_core.spec_decode import rejection as reference
from atom_core.spec_decode.rejection import RejectionOutput, check_inputs, draw_random
from atom_kernels_triton.argmax import _pick

BLOCK = 4096  # vocabulary entries a program reads per step of its loop
NUM_WARPS = 8
_NONE = tl.constexpr(2**31 - 1)  # no index: above every real one
_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)  # the reference's clamp on the noise


@triton.jit
def _lane_max(best, best_idx, x, idx):
    """Each lane's first maximum so far (a NaN beats every number; the first NaN stays)."""
    take = (x > best) | ((x != x) & (best == best))
    return tl.where(take, x, best), tl.where(take, idx, best_idx)


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = offs
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
        best, best_idx = _lane_max(best, best_idx, x, idx)
    _, at = _pick(best, best_idx, best_idx < vocab, _NONE)
    return at


@triton.jit
def _rejection_kernel(
    probs_ptr, probs_stride, draft_ptr, q_ptr, q_stride, meta_ptr, u_ptr, u_stride,
    noise_ptr, noise_stride, tokens_ptr, token_probs_ptr, out_stride, counts_ptr,
    num_seqs, vocab, width,
    HAS_Q: tl.constexpr, BLOCK: tl.constexpr, WIDTH_BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    first_row = tl.load(meta_ptr + 3 * s).to(tl.int64)  # the sequence's first target row
    k = tl.load(meta_ptr + 3 * s + 1)
    greedy = tl.load(meta_ptr + 3 * s + 2) != 0
    first_draft = first_row - s  # each earlier sequence has one row more than drafts

    if greedy:
        # Row j's argmax verifies draft j; the first row whose argmax is not its draft
        # (the bonus row k has none) gives the final token.
        accepted = k * 0
        go = k >= 0
        final = k * 0
        while go:
            final = _row_argmax(probs_ptr + (first_row + accepted) * probs_stride, vocab, BLOCK)
            has_draft = accepted < k
            x = tl.load(draft_ptr + first_draft + accepted, mask=has_draft, other=-1)
            go = has_draft & (x == final)
            accepted += go.to(tl.int32)
    else:
        # Draft j passes when u_j * q_j(x_j) < p_j(x_j) (u_j < p_j(x_j) for a one-hot q).
        accepted = k * 0
        go = k > 0
        while go:
            x = tl.load(draft_ptr + first_draft + accepted)
            p = tl.load(probs_ptr + (first_row + accepted) * probs_stride + x)
            u = tl.load(u_ptr + s * u_stride + accepted)
            if HAS_Q:
                u = u * tl.load(q_ptr + (first_draft + accepted) * q_stride + x)
            passed = u < p
            accepted += passed.to(tl.int32)
            go = passed & (accepted < k)

        # The final token: argmax of residual / noise, where the residual is max(0, p - q)
        # after a rejection and p at the bonus row. Beside it the race of p itself runs,
        # for a residual that rounding left empty.
        rejected = accepted < k
        rejected_token = tl.load(draft_ptr + first_draft + accepted, mask=rejected, other=-1)
        row = probs_ptr + (first_row + accepted) * probs_stride
        q_row = q_ptr + (first_draft + accepted) * q_stride
        noise_row = noise_ptr + s.to(tl.int64) * noise_stride
        offs = tl.arange(0, BLOCK)
        best_r = tl.full([BLOCK], float("-inf"), tl.float32)
        best_p = tl.full([BLOCK], float("-inf"), tl.float32)
        idx_r = offs
        idx_p = offs
        mass = tl.zeros([BLOCK], tl.float32)
        q_end = tl.where(rejected, vocab, 0)  # q is read only after a rejection
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            valid = idx < vocab
            p = tl.load(row + idx, mask=valid, other=0.0)
            noise = tl.maximum(tl.load(noise_row + idx, mask=valid, other=1.0), _TINY)
            if HAS_Q:
                r = p - tl.load(q_row + idx, mask=idx < q_end, other=0.0)
                r = tl.where(r < 0.0, 0.0, r)  # max(0, .) that keeps a NaN, as clamp_min
            else:
                r = tl.where(idx == rejected_token, 0.0, p)
            r = tl.where(rejected, r, p)
            mass += r
            best_r, idx_r = _lane_max(
                best_r, idx_r, tl.where(valid, tl.div_rn(r, noise), float("-inf")), idx)
            best_p, idx_p = _lane_max(
                best_p, idx_p, tl.where(valid, tl.div_rn(p, noise), float("-inf")), idx)
        _, final = _pick(best_r, idx_r, idx_r < vocab, _NONE)
        _, from_p = _pick(best_p, idx_p, idx_p < vocab, _NONE)
        # The reference's emptiness test, sum <= tiny: a sum of non-negative numbers rounds
        # on the same side of it in any order.
        empty = tl.sum(mass, 0) <= _TINY
        final = tl.where(rejected & empty, from_p, final)

    # Accepted drafts, the final token, -1 after; p of each emitted token under its row
    # (0 at padding: its log is the reference's -inf).
    pos = tl.arange(0, WIDTH_BLOCK)
    drafted = pos < accepted
    tokens = tl.load(draft_ptr + first_draft + pos, mask=drafted, other=0).to(tl.int64)
    tokens = tl.where(drafted, tokens, tl.where(pos == accepted, final.to(tl.int64), -1))
    emitted = pos <= accepted
    token_p = tl.load(probs_ptr + (first_row + pos) * probs_stride + tl.maximum(tokens, 0),
                      mask=emitted, other=0.0)
    in_row = pos <= width
    tl.store(tokens_ptr + s * out_stride + pos, tokens, mask=in_row)
    tl.store(token_probs_ptr + s * out_stride + pos, token_p, mask=in_row)
    tl.store(counts_ptr + s, accepted.to(tl.int64))
    tl.store(counts_ptr + num_seqs + s, accepted.to(tl.int64) + 1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    greedy: Sequence[bool] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> RejectionOutput:
    """``atom_core.spec_decode.rejection.rejection_sample`` (arguments, draws and results
    alike) in one kernel. Probabilities other than fp32 go to the reference, whose
    arithmetic in their dtype the kernel does not repeat."""
    if target_probs.dtype != torch.float32 or (
        draft_probs is not None and draft_probs.dtype != torch.float32
    ):
        return reference.rejection_sample(
            target_probs, draft_token_ids, num_draft_tokens, draft_probs, greedy, generators
        )
    greedy, generators = check_inputs(
        target_probs, draft_token_ids, num_draft_tokens, draft_probs, greedy, generators
    )
    num_seqs = len(num_draft_tokens)
    vocab = target_probs.shape[1]
    width = max(num_draft_tokens, default=0)
    device = target_probs.device
    uniforms, noise = draw_random(num_draft_tokens, greedy, generators, vocab, device)

    meta: list[int] = []
    first_row = 0
    for k, g in zip(num_draft_tokens, greedy):
        meta += [first_row, k, int(g)]
        first_row += k + 1
    meta_t = host_to_device(meta, torch.int32, device)

    probs = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    q = probs  # never read without draft_probs (HAS_Q=False)
    if draft_probs is not None:
        q = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    token_ids = torch.empty(num_seqs, width + 1, dtype=torch.long, device=device)
    token_probs = torch.empty(num_seqs, width + 1, dtype=torch.float32, device=device)
    counts = torch.empty(2, num_seqs, dtype=torch.long, device=device)
    if num_seqs:
        # All-greedy batches draw no noise; the kernel then never reads it.
        noise_t = noise if noise is not None else probs
        _rejection_kernel[(num_seqs,)](
            probs, probs.stride(0), draft_token_ids.contiguous(), q, q.stride(0), meta_t,
            uniforms, uniforms.stride(0), noise_t, noise_t.stride(0), token_ids, token_probs,
            width + 1, counts, num_seqs, vocab, width,
            HAS_Q=draft_probs is not None, BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
            WIDTH_BLOCK=triton.next_power_of_2(width + 1), num_warps=NUM_WARPS,
        )
    return RejectionOutput(
        token_ids=token_ids,
        num_tokens=counts[1],
        num_accepted=counts[0],
        logprobs=token_probs.log_(),
    )
