"""Speculative decoding in the engine: drafts proposed after each step, verified by the next.

After a step's tokens are appended, the proposer (``--method``, from the
``register_spec_decode_proposers`` hook) proposes up to ``--num-speculative-tokens`` drafts
for every sequence that decodes next (a draft network runs inside the step instead, over
the rows the target computed: engine/drafter.py); ``Sequence.spec_tokens`` holds them. The
scheduler gives such a sequence ``1 + k`` tokens (its newest token, then the drafts), the
model runner computes logits at all of them in the one forward, and ``verify`` keeps the
accepted prefix plus one token of the target's (a correction, or the bonus when all drafts
pass): every emitted token is distributed as the target alone would draw it
(spec_decode/rejection.py).
The scheduler then counts only the verified tokens as computed: a rejected draft's KV lies
past them and the next step overwrites it.

Drafts go only to sequences whose sampling needs no token history or per-token host reads
(no logprobs, no penalties): their verify rows are plain distributions. Steps with drafts
run one at a time (the next step's drafts depend on this step's tokens). A step where every
sequence decodes runs each draft as a decode row of its own (from the decode CUDA graphs on
a GPU: engine/spec_steps.py); one that also holds prompt tokens runs eagerly.
``--spec-decode-acceptance-length``/``-rate`` force the number accepted instead (benchmarks
only; spec_decode/forced.py).
"""

from __future__ import annotations

import itertools
import logging

import torch

from atom_core.config import Config
from atom_core.engine.drafter import Drafter
from atom_core.engine.sequence import Sequence
from atom_core.layers.sampler import Sampler, SamplingBatch
from atom_core.layers.transfer import host_to_device
from atom_core.ops import resolve_op
from atom_core.plugins import get_registries
from atom_core.spec_decode.forced import resolve_acceptance_length, sample_forced_accepts
from atom_core.spec_decode.proposer import DraftNetwork, ProposerContext, TokenProposer
from atom_core.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

def drafts_allowed(seq: Sequence) -> bool:
    """Sampling whose verify rows are plain distributions: no logprobs, no penalties."""
    sp = seq.sampling_params
    return (sp.logprobs is None and sp.repetition_penalty == 1.0
            and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0)


class Speculator:
    """The proposer, the number of drafts and the statistics of one engine.

    A ``TokenProposer`` proposes here, after each step; a ``DraftNetwork`` runs in the
    model runner beside the target (``drafter``), and ``take`` hands its drafts on."""

    def __init__(self, config: Config, max_model_len: int, ctx: ProposerContext) -> None:
        spec = config.speculative_config
        assert spec.method is not None
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        proposer = get_registries().proposers.get(spec.method)(ctx)
        self.proposer: TokenProposer | None = None
        self.drafter: Drafter | None = None
        if isinstance(proposer, TokenProposer):
            self.proposer = proposer
        elif isinstance(proposer, DraftNetwork):
            self.drafter = Drafter(proposer, config.cache_config.block_size, ctx.device)
        else:
            raise TypeError(f"--method {spec.method}: {type(proposer).__name__} is neither a "
                            "TokenProposer nor a DraftNetwork (spec_decode/proposer.py)")
        self.forced_length: float | None = None
        self.force_acceptance(resolve_acceptance_length(
            self.k, spec.spec_decode_acceptance_length, spec.spec_decode_acceptance_rate))
        self.stats = SpecDecodeStats(self.k)

    def force_acceptance(self, length: float | None) -> None:
        """Accept drafts by the minimum-variance schedule of mean ``length`` (the target's
        own token included) instead of by agreement; None: verify for real. Benchmarks
        switch it between runs of one engine."""
        if length is not None:
            resolve_acceptance_length(self.k, length, None)  # range check
            logger.warning("forced acceptance length %.2f: drafts are accepted without "
                           "agreeing with the model; the generated text is meaningless", length)
        self.forced_length = length

    @property
    def forced(self) -> tuple[float, int] | None:
        """(forced acceptance length, k) for ``verify``, or None."""
        return None if self.forced_length is None else (self.forced_length, self.k)

    @property
    def lookahead(self) -> int:
        """KV slots a step's sampling sequences need past it (the drafter's writes)."""
        return self.k if self.drafter is not None else 0

    def draft_limit(self, seq: Sequence, new_tokens: int = 0) -> int:
        """Drafts ``seq`` may take once ``new_tokens`` more are appended: as many as it may
        still emit beyond the verified token (max_tokens, the context length), at most k;
        none where its sampling reads the token history."""
        if not drafts_allowed(seq):
            return 0
        room = min(seq.sampling_params.max_tokens - seq.num_output_tokens,
                   self.max_model_len - seq.num_tokens) - new_tokens - 1
        return max(0, min(room, self.k))

    def propose(self, seqs: list[Sequence]) -> None:
        """A token proposer's drafts for each sequence that decodes next."""
        assert self.proposer is not None
        chosen: list[Sequence] = []
        limits: list[int] = []
        for seq in seqs:
            seq.spec_tokens = []
            if (seq.is_finished or seq.num_uncomputed_tokens != 1
                    or seq.num_computed_tokens < seq.num_prompt_tokens):
                continue
            limit = self.draft_limit(seq)
            if limit > 0:
                chosen.append(seq)
                limits.append(limit)
        if not chosen:
            return
        proposals = self.proposer.propose([s.token_ids for s in chosen], self.k)
        for seq, drafts, limit in zip(chosen, proposals, limits, strict=True):
            seq.spec_tokens = self._padded(list(drafts[:limit]), limit, seq)

    def take(self, seqs: list[Sequence], drafts: dict[int, list[int]]) -> None:
        """The drafter's drafts for the sequences of the step just run (the others keep
        theirs: nothing they depend on changed)."""
        for seq in seqs:
            found = drafts.get(seq.seq_id, []) if not seq.is_finished else []
            seq.spec_tokens = self._padded(found, len(found), seq)

    def _padded(self, drafts: list[int], limit: int, seq: Sequence) -> list[int]:
        if self.forced_length is not None:
            # Forced acceptance ignores the drafts' values: always offer the full
            # count, so the schedule (not the proposer's hit rate) sets the length.
            drafts += [seq.token_ids[-1]] * (limit - len(drafts))
        return drafts


def verify_sampling_batch(seqs: list[Sequence], counts: list[int],
                          device: torch.device) -> SamplingBatch:
    """The sampling fields of a verify step's rows: sequence i's ``counts[i]`` rows (its
    drafts, then the bonus) all sample as it does. It holds no token history (drafted
    sequences have no penalties), so a runner may reuse it while the rows stay the same."""
    rows = [s.sampling_params for s, c in zip(seqs, counts, strict=True) for _ in range(c)]
    return SamplingBatch.build(rows, [[]] * len(rows), [[]] * len(rows), [None] * len(rows),
                               device)


def verify(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
    generators: list[torch.Generator | None], forced: tuple[float, int] | None = None,
    sbatch: SamplingBatch | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Emitted tokens and accepted drafts per sequence, read on the host (one copy); see
    ``verify_device``."""
    token_ids, num_accepted = verify_device(sampler, logits, seqs, drafts, generators, forced,
                                            sbatch)
    rows = torch.cat([num_accepted[:, None], token_ids], dim=1).tolist()
    return [row[1 : row[0] + 2] for row in rows], [row[0] for row in rows]


def verify_device(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
    generators: list[torch.Generator | None], forced: tuple[float, int] | None = None,
    sbatch: SamplingBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(emitted tokens [S, K+1], -1 past each sequence's; accepted drafts [S]), on the
    device. ``logits`` [N, V]: sequence by sequence, ``len(drafts[i]) + 1`` rows each (row
    j scores draft j; the last gives the bonus). ``forced``: (acceptance length,
    --num-speculative-tokens). ``sbatch``: ``verify_sampling_batch`` of these rows, if the
    caller kept one."""
    device = logits.device
    counts = [len(d) for d in drafts]
    if sbatch is None:
        sbatch = verify_sampling_batch(seqs, [k + 1 for k in counts], device)
    probs = sampler.probs(logits, sbatch)
    draft_ids = host_to_device([t for d in drafts for t in d], torch.long, device)
    greedy = [s.sampling_params.greedy for s in seqs]
    if forced is None:
        out = resolve_op("rejection_sample", device)(probs, draft_ids, counts, None, greedy,
                                                     generators)
        return out.token_ids, out.num_accepted
    # Forced: accept a scheduled number of drafts, then the target's own token at the
    # first unaccepted row (its argmax, or a draw for sampled sequences).
    width = max(counts, default=0)
    accepted = host_to_device(sample_forced_accepts(forced[0], forced[1], len(seqs)).tolist(),
                              torch.long, device)
    accepted = torch.minimum(accepted, host_to_device(counts, torch.long, device))
    noise = torch.empty_like(probs).exponential_()
    greedy_rows = host_to_device([g for g, k in zip(greedy, counts) for _ in range(k + 1)],
                                 torch.bool, device)
    scores = torch.where(greedy_rows[:, None], probs, probs / noise.clamp_min_(1e-30))
    starts = host_to_device([0, *itertools.accumulate(k + 1 for k in counts)][:-1],
                            torch.long, device)
    target = scores.argmax(dim=-1).index_select(0, starts + accepted)
    padded = torch.full((len(seqs), width + 1), -1, dtype=torch.long, device=device)
    if width:
        flat = [i * (width + 1) + j for i, k in enumerate(counts) for j in range(k)]
        padded.view(-1).index_copy_(0, host_to_device(flat, torch.long, device), draft_ids)
    pos = torch.arange(width + 1, device=device)
    token_ids = torch.where(pos < accepted[:, None], padded, -1)
    token_ids.scatter_(1, accepted[:, None], target[:, None])
    return token_ids, accepted
