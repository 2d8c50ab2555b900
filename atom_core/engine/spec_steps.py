"""The model runner's speculative steps (engine/spec_decode.py says what they do).

A step where every sequence decodes runs its drafts as decode rows (``_launch_rows``: from
the decode graphs on the GPU) and is verified whole; with a draft network, the network
then runs on the device and the step's result is read once (``_verify_and_draft``).
A step with drafts beside prompt chunks runs eagerly (``_verify``). After an eager step a
draft network runs over the rows the target kept (``_draft``).
"""

from __future__ import annotations

import torch

from atom_core.engine.drafter import DraftRows
from atom_core.engine.scheduler import ScheduledBatch
from atom_core.engine.sequence import Logprob, Sequence
from atom_core.engine.spec_decode import (
    drafts_allowed,
    verify,
    verify_device,
    verify_sampling_batch,
)
from atom_core.engine.step_inputs import EagerInputs, eager_inputs
from atom_core.engine.step_results import PendingStep
from atom_core.layers.context import forward_context
from atom_core.layers.sampler import SamplingBatch
from atom_core.layers.transfer import host_to_device


class SpeculativeSteps:
    """Mixed into ``ModelRunner``, whose model, sampler, decode inputs, graphs, speculator
    and drafter it uses."""

    def _verify(self, batch: ScheduledBatch, inputs: EagerInputs, starts: list[int],
                sampling: list[int]) -> PendingStep:
        """A step with drafts (engine/spec_decode.py): the forward, then the sequences with
        drafts verified over all their rows, the others sampled at their last row; the
        emitted tokens are read here (steps with drafts run one at a time)."""
        seqs, counts = batch.seqs, batch.num_scheduled_tokens
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        prompt_lps: dict[int, list[Logprob | None]] = {}
        qsl = inputs.meta.query_start_loc_cpu
        self._prompt_logprobs(seqs, starts, counts, qsl, hidden, prompt_lps)
        spec = [i for i in sampling if batch.drafts[i]]
        plain = [i for i in sampling if not batch.drafts[i]]
        pending = PendingStep([], torch.empty(0, dtype=torch.long),
                              torch.empty(0, dtype=torch.long), None, [], prompt_lps)
        if plain:
            chosen = [seqs[i] for i in plain]
            last = host_to_device([qsl[i + 1] - 1 for i in plain], torch.long, self.device)
            result = self.sampler(self.model.compute_logits(hidden.index_select(0, last)),
                                  self._sampling_batch(chosen))
            tokens = result.token_ids.cpu()
            pending = PendingStep(chosen, tokens, tokens, None, result.logprobs, prompt_lps)
        rows = [r for i in spec for r in range(qsl[i + 1] - len(batch.drafts[i]) - 1, qsl[i + 1])]
        logits = self.model.compute_logits(
            hidden.index_select(0, host_to_device(rows, torch.long, self.device)))
        chosen = [seqs[i] for i in spec]
        emitted, accepted = verify(
            self.sampler, logits, chosen, [batch.drafts[i] for i in spec],
            [self._generator(s) for s in chosen],
            self.speculator.forced if self.speculator is not None else None,
        )
        for s, toks, a in zip(chosen, emitted, accepted, strict=True):
            pending.emitted[s.seq_id] = toks
            pending.accepted[s.seq_id] = a
        if self.drafter is not None:
            new = dict(zip(plain, ([t] for t in pending.host.tolist()), strict=True))
            new.update(zip(spec, emitted, strict=True))
            pending.drafts = self._draft(batch, starts, qsl, self._draft_hidden(hidden), new)
        return pending

    def is_row_verify(self, batch: ScheduledBatch) -> bool:
        """Every sequence decodes (its newest token, then any drafts) and samples plainly
        (no logprobs, no penalties): the step runs as decode rows and is verified whole.
        With a draft network every such step does (its drafts come from the rows), else
        only steps with drafts."""
        if self.speculator is None or not (batch.has_drafts or self.drafter is not None):
            return False
        for s, n, d in zip(batch.seqs, batch.num_scheduled_tokens, batch.drafts, strict=True):
            if n != 1 + len(d) or s.num_computed_tokens + 1 != s.num_tokens:
                return False
            if not drafts_allowed(s):
                return False
        return True

    def _launch_rows(self, batch: ScheduledBatch) -> PendingStep:
        """A verify step as decode rows, one per token (the newest, then each draft), each
        over its sequence's block table with context up to that token: on the GPU from the
        decode graphs (engine/cuda_graphs.py), which compute every row's logits. Emitted
        tokens are read here (steps with drafts run one at a time)."""
        seqs, drafts = batch.seqs, batch.drafts
        counts = [1 + len(d) for d in drafts]
        n, most = sum(counts), max(counts)
        inputs = self.decode_inputs
        hidden: torch.Tensor | None = None
        if inputs is not None and n <= inputs.max_seqs:
            padded = self.graphs.padded_size(n) if self.graphs is not None else None
            lens = inputs.prepare(seqs, padded or n, drafts)
            if padded is not None:
                logits, hidden = self.graphs.replay(padded)
                logits = logits[:n]
                hidden = hidden[:n] if hidden is not None else None
            else:
                meta = inputs.metadata(n, lens, self.config.scheduler_config.max_model_len or 1,
                                       most)
                with forward_context(meta):
                    out = self.model(inputs.input_ids(n), inputs.positions(n))
                logits, hidden = self.model.compute_logits(out), self._draft_hidden(out)
        else:
            starts = [s.num_computed_tokens + j for s, c in zip(seqs, counts) for j in range(c)]
            tables = [s.block_table for s, c in zip(seqs, counts) for _ in range(c)]
            ids = [t for s, d in zip(seqs, drafts) for t in (s.token_ids[-1], *d)]
            rows = eager_inputs(None, starts, [1] * n, tables, self.block_size, self.device)
            rows.meta.new_rows_per_seq = most
            with forward_context(rows.meta):
                out = self.model(host_to_device(ids, torch.long, self.device), rows.positions)
            logits, hidden = self.model.compute_logits(out), self._draft_hidden(out)
        assert self.speculator is not None
        if self.drafter is not None:
            return self._verify_and_draft(batch, counts, logits, hidden)
        emitted, accepted = verify(self.sampler, logits, seqs, drafts,
                                   [self._generator(s) for s in seqs], self.speculator.forced,
                                   self._verify_batch(seqs, counts))
        nothing = torch.empty(0, dtype=torch.long)
        pending = PendingStep([], nothing, nothing, None, [])
        for s, toks, a in zip(seqs, emitted, accepted, strict=True):
            pending.emitted[s.seq_id] = toks
            pending.accepted[s.seq_id] = a
        return pending

    def _verify_and_draft(self, batch: ScheduledBatch, counts: list[int],
                          logits: torch.Tensor, hidden: torch.Tensor | None) -> PendingStep:
        """Verify a step of decode rows and run the draft network after it, reading the
        result on the host once, at the end (engine/drafter.py ``propose_verified``)."""
        assert self.drafter is not None and self.speculator is not None
        seqs, drafts = batch.seqs, batch.drafts
        token_ids, num_accepted = verify_device(
            self.sampler, logits, seqs, drafts, [self._generator(s) for s in seqs],
            self.speculator.forced, self._verify_batch(seqs, counts))
        # As many drafts as each may take if every draft is accepted: the bound the
        # lookahead slots and the context length allow whatever the host reads.
        wanted = [self.speculator.draft_limit(s, 1 + len(d)) for s, d in zip(seqs, drafts)]
        proposed = self.drafter.propose_verified(seqs, counts, token_ids, num_accepted, hidden,
                                                 wanted)
        num, width = token_ids.shape
        host = torch.cat([num_accepted, token_ids.flatten(), *proposed]).tolist()
        nothing = torch.empty(0, dtype=torch.long)
        pending = PendingStep([], nothing, nothing, None, [])
        for i, s in enumerate(seqs):
            a = host[i]
            pending.emitted[s.seq_id] = host[num + i * width : num + i * width + a + 1]
            pending.accepted[s.seq_id] = a
        pending.drafts = self.drafter.collect(seqs, wanted, proposed,
                                              host[num + num * width :])
        return pending

    def _verify_batch(self, seqs: list[Sequence], counts: list[int]) -> SamplingBatch:
        """A decode-row verify step's sampling fields, reused while its sequences and row
        counts repeat (a steady batch): building them costs host time every step."""
        key = tuple(zip((s.seq_id for s in seqs), counts))
        cached = self._verify_cache
        if cached is None or cached[0] != key:
            cached = self._verify_cache = (key, verify_sampling_batch(seqs, counts,
                                                                      self.device))
        return cached[1]

    def _draft_hidden(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The draft network's hidden input for the target's output rows, where it reads
        one."""
        if self.drafter is None or not self.drafter.network.reads_target_hidden:
            return None
        return self.drafter.network.target_hidden(hidden)

    def _draft(self, batch: ScheduledBatch, starts: list[int], qsl: list[int],
               hidden: torch.Tensor | None, new: dict[int, list[int]]) -> dict[int, list[int]]:
        """The draft network over the rows the target kept (engine/drafter.py). ``new``:
        the tokens each sampling sequence (by batch index) emitted this step; ``hidden``:
        the network's hidden input for the step's rows, where it reads one."""
        assert self.drafter is not None and self.speculator is not None
        rows = []
        for i, (seq, n, drafts) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens,
                                                  batch.drafts, strict=True)):
            start, own = starts[i], n - len(drafts)
            emitted = new.get(i)
            if emitted is None:  # a chunk short of its prompt's end: the next token is known
                rows.append(DraftRows(seq, start, n, seq.token_ids[start : start + n + 1],
                                      qsl[i], 0))
                continue
            # The kept rows: the sequence's own tokens and the accepted drafts.
            rows.append(DraftRows(seq, start, own + len(emitted) - 1,
                                  seq.token_ids[start : start + own] + emitted, qsl[i],
                                  self.speculator.draft_limit(seq, len(emitted))))
        return self.drafter.propose(rows, hidden)
