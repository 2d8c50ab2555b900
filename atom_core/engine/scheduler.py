"""Continuous batching: which sequences compute how many tokens in the next step.

Steps are unified (vLLM v1 style): a step is a list of (sequence, tokens to compute), where a
decode is 1 token and a prefill chunk is many, so one step can mix running decodes with a
new prompt's chunk. Preemption is by recompute: a preempted sequence drops its KV and later
prefills all its tokens (prompt and generated so far) again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from atom_core.config import SchedulerConfig
from atom_core.engine.block_manager import BlockManager
from atom_core.engine.sequence import Sequence, SequenceStatus
from atom_core.errors import InvalidRequestError


@dataclass
class ScheduledBatch:
    """One step's work. ``sample_mask[i]``: seqs[i] reaches its last token this step, so the
    engine samples its next token (fixed at schedule time, before ``advance``)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    sample_mask: list[bool] = field(default_factory=list)
    scheduled_at: float = 0.0
    # Draft tokens each entry verifies after its newest token (speculative decoding): such
    # an entry computes 1 + len(drafts) tokens, the drafts not in its token ids.
    drafts: list[list[int]] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int, drafts: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        self.drafts.append(drafts or [])
        extra = len(drafts) if drafts else 0
        self.sample_mask.append(seq.num_computed_tokens + num_tokens - extra == seq.num_tokens)

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """FCFS continuous batching under a token budget, with chunked prefill and preemption.

    ``running`` is kept in arrival order: preempted sequences go back to the front of
    ``waiting`` and are re-admitted before anything newer, so the most recently arrived
    running sequence is always the last one, and that is the one preempted.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        lookahead: int = 0,
    ):
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.mixed_prefill_tokens = (
            scheduler_config.mixed_prefill_tokens or scheduler_config.max_num_batched_tokens
        )
        self.prefill_deadline = scheduler_config.prefill_deadline_ms / 1000.0
        self.delay_factor = scheduler_config.scheduler_delay_factor
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.clock = clock
        # KV slots allocated past a step that samples: a draft network writes there.
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}  # unfinished, by request id
        self._arrival: dict[str, float] = {}  # clock() at add, for scheduler_delay_factor
        self._last_step_latency = 0.0

    # ---- requests ------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue seq (FCFS). Refuses a request whose KV could never fit in the whole pool:
        it would otherwise preempt itself forever."""
        if seq.request_id in self._requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        bm = self.block_manager
        # Longest the sequence can grow; sized conservatively (the last sampled token's KV
        # is never written) so that one sequence alone can always finish.
        max_len = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens + self.lookahead,
                      self.max_model_len)
        max_len = max(max_len, seq.num_tokens)
        needed = (max_len + bm.block_size - 1) // bm.block_size
        if needed > bm.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {max_len} tokens of KV cache ({needed} blocks) but the cache "
                f"holds only {bm.num_blocks * bm.block_size} tokens ({bm.num_blocks} blocks); "
                "shorten the prompt or max_tokens"
            )
        seq.status = SequenceStatus.WAITING
        self._requests[seq.request_id] = seq
        self._arrival[seq.request_id] = self.clock()
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request with reason "abort"; False if unknown/finished."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self.finish(seq, "abort")
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and release its blocks at once."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        del self._requests[seq.request_id]
        del self._arrival[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.finish_time is None:
            seq.finish_time = time.monotonic()
        self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self, skip: Collection[int] = ()) -> ScheduledBatch:
        """Pick the next step: running sequences first (FCFS), then new admissions. ``skip``:
        ids of running sequences to leave out (with --async-scheduling, those whose queued
        step's token is certain to be their last).

        A step holds at most --max-num-batched-tokens tokens, and while any sequence decodes,
        at most --mixed-prefill-tokens of them are prompt tokens (``prefill`` below): each
        decode then waits for one bounded chunk of prefill, not for whole prompts. Prompts
        past --prefill-deadline-ms lift that cap by what they have left to compute."""
        batch = ScheduledBatch(scheduled_at=self.clock())
        budget = self.max_num_batched_tokens
        decoding = any(self._decodes(s) and s.seq_id not in skip for s in self.running)
        prefill = budget
        if decoding:
            prefill = max(self.mixed_prefill_tokens, self._overdue_tokens(batch.scheduled_at))

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            decodes = self._decodes(seq)
            n = min(seq.num_uncomputed_tokens, budget if decodes else min(budget, prefill))
            if n <= 0 or seq.seq_id in skip:  # nothing to compute (or nothing more to): skip
                i += 1
                continue
            drafts = seq.spec_tokens[: budget - 1] if decodes else []
            ahead = self._lookahead(seq, n, len(drafts))
            n += len(drafts)
            if not self._allocate_or_preempt(seq, n + ahead, batch):
                break  # seq preempted itself: it was the last running sequence
            batch.add(seq, n, drafts)
            budget -= n
            if not decodes:
                prefill -= n
            i += 1
        budget = min(budget, prefill)  # what admissions may take: prompt tokens only

        # Admitting while preempting would just thrash; the preempted go first next step.
        if batch.num_preempted == 0 and self._admission_allowed(batch.scheduled_at):
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                # Prompt logprobs need the whole prompt computed, so no cache hits for them.
                use_cache = seq.sampling_params.prompt_logprobs is None
                hits = self.block_manager.prefix_hit_tokens(seq, use_cache)
                n = min(seq.num_tokens - hits, budget)
                ahead = self._lookahead(seq, n, 0, hits)
                if not self.block_manager.allocate(seq, n + ahead, use_cache):
                    break  # FCFS: nothing overtakes a sequence that does not fit
                assert seq.num_computed_tokens == hits
                self.waiting.popleft()
                seq.mark_scheduled()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                batch.add(seq, n)
                budget -= n
        return batch

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        """seq has its prompt computed and computes one token, its newest, next."""
        return seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens

    def _overdue_tokens(self, now: float) -> int:
        """Tokens left to compute of the prompts (running chunked prefills, then the waiting,
        oldest first) that arrived --prefill-deadline-ms or more before ``now``. FCFS gives
        the lifted budget to them: nothing newer is ahead of them in either queue. Runs every
        step, so neither queue is scanned past what can count."""
        if self.prefill_deadline <= 0:
            return 0
        cutoff = now - self.prefill_deadline
        total = 0
        # Prompts still prefilling are the newest admissions, the tail of running: prompt
        # tokens go to running sequences in order, so an earlier prompt finishes first. A
        # decode (or, with async scheduling, a sequence whose token is in flight) ends it.
        for seq in reversed(self.running):
            if seq.num_uncomputed_tokens <= 1:
                break
            if self._arrival[seq.request_id] <= cutoff:
                total += seq.num_uncomputed_tokens
        for seq in self.waiting:  # in arrival order: stop at the first that is not late
            if self._arrival[seq.request_id] > cutoff:
                break
            total += seq.num_tokens
        return total

    def _lookahead(self, seq: Sequence, n: int, drafts: int, computed: int | None = None) -> int:
        """Lookahead slots for seq computing ``n`` of its own tokens and ``drafts`` more from
        ``computed`` (default: what it has): only where the step samples, and never past
        --max-model-len."""
        start = seq.num_computed_tokens if computed is None else computed
        if self.lookahead == 0 or start + n < seq.num_tokens:
            return 0
        return max(0, min(self.lookahead, self.max_model_len - start - n - drafts))

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Allocate for running seq, preempting the most recent running sequences until it
        fits. Victims come from the tail, which is never already scheduled this step.
        False when seq itself had to go."""
        while not self.block_manager.allocate(seq, n):
            victim = self.running.pop()
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _admission_allowed(self, now: float) -> bool:
        """scheduler_delay_factor, as vLLM: admit prompts only once the oldest waiting one has
        waited delay * (last step's latency), so that arrivals batch up into one prefill.
        Never wait with nothing running. The oldest waiting is the front: waiting is in
        arrival order (the preempted, at the front, arrived earliest)."""
        if self.delay_factor <= 0 or not self.running or not self.waiting:
            return True
        waited = now - self._arrival[self.waiting[0].request_id]
        return waited >= self.delay_factor * self._last_step_latency

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop seq's KV; it prefills all its tokens again later.
        Its generated tokens stay (num_prompt_tokens unchanged), so nothing is lost."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.spec_tokens = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def advance(self, batch: ScheduledBatch, accepted: dict[int, int] | None = None) -> None:
        """Record that the model computed the batch: progress, newly full blocks, latency.
        ``accepted``: drafts accepted per sequence id; a rejected draft's KV is past the
        computed tokens, so the next step overwrites it (its blocks stay the sequence's)."""
        for seq, n, drafts in zip(batch.seqs, batch.num_scheduled_tokens, batch.drafts,
                                  strict=True):
            if seq.is_finished:  # aborted while the step ran
                continue
            if drafts:
                n -= len(drafts) - (accepted or {}).get(seq.seq_id, 0)
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq)
        self._last_step_latency = self.clock() - batch.scheduled_at
