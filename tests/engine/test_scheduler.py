"""Scheduler: a randomized property test with a fake model, plus targeted cases."""

from __future__ import annotations

import random

import pytest

from atom_core.config import SchedulerConfig
from atom_core.engine.block_manager import BlockManager
from atom_core.engine.scheduler import ScheduledBatch, Scheduler
from atom_core.engine.sequence import Sequence, SequenceStatus
from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, max_tokens_per_step=16, caching=False,
                   delay=0.0, clock=None, max_model_len=256, mixed_prefill=0,
                   deadline_ms=0.0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_per_step,
                             scheduler_delay_factor=delay, mixed_prefill_tokens=mixed_prefill,
                             prefill_deadline_ms=deadline_ms)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    kwargs = {"clock": clock} if clock else {}
    return Scheduler(config, bm, max_model_len, **kwargs)


def make_seq(tokens: list[int], max_tokens: int = 4, rid: str | None = None, **sp) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens, **sp), request_id=rid)


def model_token(seq: Sequence, pos: int) -> int:
    """The fake model's output at position pos: fixed per (sequence, position), so a token
    lost or sampled twice across a preemption shows up in the output."""
    return (seq.seq_id * 31 + pos) % 97


def step(sched: Scheduler, batch: ScheduledBatch | None = None) -> ScheduledBatch:
    """Run the fake model over one scheduled batch, as the engine would."""
    batch = sched.schedule() if batch is None else batch
    mask = list(batch.sample_mask)
    sched.advance(batch)
    for seq, sample in zip(batch.seqs, mask, strict=True):
        if sample and not seq.is_finished:
            seq.append_token(model_token(seq, seq.num_tokens))
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish(seq, "length")
    return batch


# ---- the property test ----------------------------------------------------------------


class FakeKV:
    """What each KV slot holds: checks hits and shared blocks hold the right tokens and
    that nothing writes into a block another sequence also references."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            for pos in range(seq.num_computed_tokens):
                slot = (seq.block_table[pos // BS], pos % BS)
                assert self.slots.get(slot) == seq.token_ids[pos], "wrong KV reused"
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[pos // BS]
                assert self.bm.blocks[block].ref_count == 1, "write into a shared block"
                self.slots[(block, pos % BS)] = seq.token_ids[pos]


@pytest.mark.parametrize(("mixed_prefill", "deadline_steps"), [(0, 0), (3, 0), (3, 4)])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_invariants(caching: bool, seed: int, mixed_prefill: int,
                               deadline_steps: int):
    rng = random.Random(seed)
    max_seqs, budget, num_blocks = 4, 16, 12
    clock = [0.0]  # one second a step: the deadline is a number of steps
    sched = make_scheduler(num_blocks, max_seqs, budget, caching=caching,
                           mixed_prefill=mixed_prefill, deadline_ms=deadline_steps * 1000.0,
                           clock=lambda: clock[0])
    bm = sched.block_manager
    kv = FakeKV(bm)
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (5, 9, 13)]
    order: dict[int, int] = {}  # seq_id -> arrival index
    added: list[Sequence] = []
    finished: dict[int, Sequence] = {}
    first_admission: list[int] = []
    num_requests, preemptions, steps, lifted = 150, 0, 0, 0

    def on_finished(seq: Sequence) -> None:
        assert seq.seq_id not in finished, "finished twice"
        assert seq.block_table == []
        finished[seq.seq_id] = seq

    while len(added) < num_requests or sched.has_unfinished():
        steps += 1
        assert steps < 5000, "scheduler hung"
        for _ in range(rng.choice([0, 0, 1, 2])):  # arrivals
            if len(added) < num_requests:
                tokens = (rng.choice(prefixes)[: rng.randrange(1, 14)]
                          + [rng.randrange(50)] * rng.randrange(3))
                seq = make_seq(tokens, max_tokens=rng.randrange(1, 12),
                               prompt_logprobs=1 if rng.random() < 0.1 else None)
                order[seq.seq_id] = len(added)
                added.append(seq)
                sched.add(seq)
        if rng.random() < 0.04:  # random abort of an unfinished request
            live = [s for s in added if not s.is_finished]
            if live:
                victim = rng.choice(live)
                assert sched.abort(victim.request_id)
                assert victim.finish_reason == "abort"
                on_finished(victim)
                assert not sched.abort(victim.request_id)

        clock[0] += 1.0
        batch = sched.schedule()
        preemptions += batch.num_preempted
        # Budget, slots, uniqueness, coverage.
        assert batch.total_tokens <= budget and len(batch) <= max_seqs
        assert len({s.seq_id for s in batch.seqs}) == len(batch)
        decoding = [s.num_computed_tokens >= s.num_prompt_tokens and n == 1
                    for s, n in zip(batch.seqs, batch.num_scheduled_tokens)]
        if mixed_prefill and any(decoding):
            prompt_tokens = sum(n for n, d in zip(batch.num_scheduled_tokens, decoding) if not d)
            lifted += prompt_tokens > mixed_prefill
            assert deadline_steps or prompt_tokens <= mixed_prefill
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= n <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
            if seq.sampling_params.prompt_logprobs is not None:
                assert seq.num_cached_tokens == 0
            if seq.seq_id not in first_admission:
                first_admission.append(seq.seq_id)
        # Every unfinished sequence is in exactly one queue; only the running hold blocks.
        assert len(sched.running) <= max_seqs
        queued = [s.seq_id for s in sched.waiting] + [s.seq_id for s in sched.running]
        assert len(queued) == len(set(queued))
        assert set(queued) == {s.seq_id for s in added if not s.is_finished}
        assert all(s.block_table == [] and s.num_computed_tokens == 0 for s in sched.waiting)
        admitted = [order[s.seq_id] for s in sched.running]
        assert admitted == sorted(admitted)
        refs = [0] * num_blocks
        for s in sched.running:
            for b in s.block_table:
                refs[b] += 1
        assert refs == [b.ref_count for b in bm.blocks]
        assert bm.num_free_blocks == refs.count(0)

        kv.run(batch)
        for seq in step(sched, batch).seqs:
            if seq.is_finished and seq.seq_id not in finished:
                on_finished(seq)

    assert len(finished) == num_requests and not sched.has_unfinished()
    assert bool(lifted) == bool(deadline_steps and mixed_prefill)  # the deadline was hit
    assert preemptions > 0
    assert first_admission == sorted(first_admission, key=order.get), "FCFS admission order"
    for seq in added:
        expected = [model_token(seq, p) for p in range(seq.num_prompt_tokens, seq.num_tokens)]
        assert seq.output_token_ids == expected, "token lost or duplicated"
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.sampling_params.max_tokens
        else:
            assert seq.finish_reason == "abort"
            assert seq.num_output_tokens <= seq.sampling_params.max_tokens
    assert bm.num_free_blocks == num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    if caching:
        assert bm.prefix_cache_hits > 0


# ---- targeted cases ----------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_and_mixes_with_others():
    sched = make_scheduler(max_tokens_per_step=8)
    a, b = make_seq(list(range(20)), max_tokens=2), make_seq([1, 2, 3], max_tokens=2)
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    assert batch.seqs == [a] and batch.num_scheduled_tokens == [8] and batch.sample_mask == [False]
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    batch = step(sched)
    assert batch.num_scheduled_tokens == [8] and a.num_computed_tokens == 16
    batch = step(sched)  # the last chunk of a, and b's whole prompt in the same step
    assert batch.seqs == [a, b] and batch.num_scheduled_tokens == [4, 3]
    assert batch.sample_mask == [True, True] and batch.total_tokens == 7
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    batch = step(sched)  # two decodes
    assert batch.num_scheduled_tokens == [1, 1]
    assert a.is_finished and b.is_finished and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


def test_prompts_beside_decodes_are_chunked_to_the_mixed_prefill_cap():
    sched = make_scheduler(num_blocks=64, max_tokens_per_step=64, mixed_prefill=8)
    a, b = make_seq(list(range(20)), max_tokens=8), make_seq(list(range(20)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    # Nothing decodes yet: the whole step budget goes to prompts.
    assert step(sched).num_scheduled_tokens == [20, 20]
    late = make_seq(list(range(30)), max_tokens=4)
    sched.add(late)
    # a and b decode now: the late prompt gets 8 tokens a step beside them, not 30 at once.
    batch = step(sched)
    assert batch.seqs == [a, b, late] and batch.num_scheduled_tokens == [1, 1, 8]
    assert step(sched).num_scheduled_tokens == [1, 1, 8]
    two_more = [make_seq(list(range(5)), max_tokens=2) for _ in range(2)]
    for seq in two_more:
        sched.add(seq)
    # The cap is shared: late's chunk of 8 leaves nothing for the new prompts this step.
    assert step(sched).seqs == [a, b, late]
    batch = step(sched)  # late's last 6 prompt tokens, then 2 of the next prompt
    assert batch.seqs == [a, b, late, two_more[0]]
    assert batch.num_scheduled_tokens == [1, 1, 6, 2]


def test_prompts_past_the_prefill_deadline_are_taken_whole():
    """A burst that arrives while others decode enters a bounded chunk a step only until
    --prefill-deadline-ms: then every overdue prompt's remaining tokens go in at once (up to
    the step budget), oldest first, and a prompt that arrived later keeps the cap."""
    now = [0.0]
    sched = make_scheduler(num_blocks=64, max_tokens_per_step=48, mixed_prefill=8,
                           deadline_ms=100.0, clock=lambda: now[0])
    a, b = make_seq(list(range(4)), max_tokens=30), make_seq(list(range(4)), max_tokens=30)
    sched.add(a)
    sched.add(b)
    step(sched)
    burst = [make_seq(list(range(20)), max_tokens=4) for _ in range(3)]
    for seq in burst:
        sched.add(seq)
    now[0] = 0.05  # within the deadline: 8 prompt tokens a step, FCFS
    assert step(sched).num_scheduled_tokens == [1, 1, 8]
    fresh = make_seq(list(range(20)), max_tokens=4)
    sched.add(fresh)  # arrives at 0.05
    now[0] = 0.1  # the burst is due: its 52 tokens left, within the 46 the decodes leave
    batch = step(sched)
    assert batch.seqs == [a, b, *burst]
    assert batch.num_scheduled_tokens == [1, 1, 12, 20, 14]
    # Next, beside five decodes: the burst's last 6 tokens; fresh is not due until 0.15, so
    # it gets what the cap leaves, 2.
    batch = step(sched)
    assert batch.seqs == [a, b, *burst, fresh]
    assert batch.num_scheduled_tokens == [1, 1, 1, 1, 6, 2]
    now[0] = 0.2  # fresh is due: all its 18 left at once
    batch = step(sched)
    assert batch.seqs[-1] is fresh and batch.num_scheduled_tokens[-1] == 18


def test_no_prefill_deadline_keeps_the_cap():
    now = [0.0]
    sched = make_scheduler(num_blocks=64, max_tokens_per_step=48, mixed_prefill=8,
                           deadline_ms=0.0, clock=lambda: now[0])
    a = make_seq(list(range(4)), max_tokens=30)
    sched.add(a)
    step(sched)
    late = make_seq(list(range(20)), max_tokens=4)
    sched.add(late)
    now[0] = 60.0
    assert step(sched).num_scheduled_tokens == [1, 8]


def test_max_num_seqs_and_fcfs_no_overtaking():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, max_tokens_per_step=64)
    a = make_seq(list(range(8)), max_tokens=4)  # 3 blocks at most
    big = make_seq(list(range(12)), max_tokens=4)  # needs 3 blocks now
    small = make_seq([1], max_tokens=1)
    for s in (a, big, small):
        sched.add(s)
    batch = sched.schedule()
    # big does not fit next to a, and small may not overtake it.
    assert batch.seqs == [a] and list(sched.waiting) == [big, small]


def test_abort_waiting_and_running_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    running, waiting = make_seq(list(range(10)), rid="r"), make_seq([1, 2], rid="w")
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.block_manager.num_free_blocks == 5
    assert sched.abort("w") and waiting.is_finished and waiting.finish_reason == "abort"
    assert sched.num_waiting == 0
    assert sched.abort("r") and running.finish_reason == "abort" and running.block_table == []
    assert sched.block_manager.num_free_blocks == 8
    assert not sched.abort("r") and not sched.abort("nope") and not sched.has_unfinished()


def test_abort_during_a_step_is_not_advanced():
    sched = make_scheduler()
    seq = make_seq(list(range(6)), rid="x")
    sched.add(seq)
    batch = sched.schedule()
    sched.abort("x")
    sched.advance(batch)
    assert seq.num_computed_tokens == 0 and sched.block_manager.num_free_blocks == 16


def test_prefix_hits_reduce_scheduled_tokens():
    sched = make_scheduler(caching=True, max_tokens_per_step=64)
    first = make_seq(list(range(10)), max_tokens=1)
    sched.add(first)
    step(sched)
    assert first.is_finished
    again = make_seq(list(range(8)) + [70, 71, 72])
    sched.add(again)
    batch = sched.schedule()
    assert batch.num_scheduled_tokens == [3] and again.num_cached_tokens == 8
    assert batch.sample_mask == [True]
    # prompt_logprobs need every prompt token computed: no hits for them.
    wants_logprobs = make_seq(list(range(8)) + [70, 71, 72], prompt_logprobs=1)
    sched.add(wants_logprobs)
    batch = sched.schedule()
    assert batch.seqs[-1] is wants_logprobs and batch.num_scheduled_tokens[-1] == 11


def test_preemption_recomputes_prompt_and_generated_tokens():
    sched = make_scheduler(num_blocks=4, max_tokens_per_step=64)
    old, new = make_seq(list(range(7)), max_tokens=9), make_seq(list(range(7)), max_tokens=9)
    sched.add(old)
    sched.add(new)
    step(sched)  # both prefill (2 blocks each) and sample
    step(sched)  # both decode the 8th token, filling their 2 blocks: pool full
    batch = step(sched)  # old needs a third block: new (most recent) is preempted
    assert batch.num_preempted == 1 and batch.seqs == [old]
    assert new.status == SequenceStatus.WAITING and new.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.block_table == [] and new.num_prompt_tokens == 7
    assert list(sched.waiting) == [new] and new.num_tokens == 9
    while not old.is_finished:
        step(sched)
    scheduled_first = new.scheduled_time
    batch = sched.schedule()  # new re-prefills its prompt and generated tokens
    assert batch.seqs == [new] and batch.num_scheduled_tokens == [new.num_tokens]
    # Its queue time ended when it was first scheduled; the recompute does not move it.
    assert scheduled_first is not None and new.scheduled_time == scheduled_first


def test_last_running_sequence_preempts_itself():
    sched = make_scheduler(num_blocks=4, max_tokens_per_step=64)
    a, b = make_seq([1] * 8, max_tokens=8), make_seq([2] * 8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)  # 2 blocks each: pool full; both sampled (9 tokens)
    batch = sched.schedule()  # a preempts b; then a is the only one, scheduled
    assert batch.seqs == [a] and batch.num_preempted == 1
    # Directly: a lone running sequence that cannot grow gives itself up.
    sched2 = make_scheduler(num_blocks=2, max_tokens_per_step=64, max_model_len=8)
    solo = make_seq([3] * 4, max_tokens=4)
    sched2.add(solo)
    step(sched2)
    assert sched2.block_manager.allocate(make_seq([9] * 4), 4)  # someone takes the last block
    batch = sched2.schedule()
    assert batch.seqs == [] and batch.num_preempted == 1 and list(sched2.waiting) == [solo]


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=3, max_tokens_per_step=5)
    a, b = make_seq([1] * 4, max_tokens=8), make_seq([2] * 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    assert step(sched).num_scheduled_tokens == [4, 1]  # b's prompt is chunked
    assert step(sched).num_scheduled_tokens == [1, 3]  # a's decode takes the last block
    batch = step(sched)  # b's decode needs a block: b, the last, preempts itself
    assert batch.seqs == [a] and batch.num_preempted == 1
    # b's first chunk would now fit (budget 4, its freed block) but is held back a step.
    assert list(sched.waiting) == [b] and sched.block_manager.num_free_blocks == 1
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_scheduled_tokens == [1, 4]


def test_request_that_can_never_fit_is_refused():
    sched = make_scheduler(num_blocks=4, max_model_len=1000)  # 16 tokens of KV
    with pytest.raises(InvalidRequestError, match="KV cache"):
        sched.add(make_seq(list(range(20))))
    with pytest.raises(InvalidRequestError):
        sched.add(make_seq(list(range(10)), max_tokens=10))  # grows past the pool
    sched.add(make_seq(list(range(10)), max_tokens=6, rid="ok"))  # exactly 16
    short = make_scheduler(num_blocks=4, max_model_len=16)
    short.add(make_seq(list(range(10)), max_tokens=100))  # capped by max_model_len
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add(make_seq([1], rid="ok"))
    assert sched.num_waiting == 1


def test_scheduler_delay_factor_with_fake_clock():
    now = [0.0]
    sched = make_scheduler(delay=0.5, clock=lambda: now[0])
    a, b, c = make_seq([1, 2, 3], max_tokens=20), make_seq([4, 5]), make_seq([6])
    sched.add(a)
    batch = sched.schedule()  # nothing running: admitted at once
    assert batch.seqs == [a]
    now[0] = 1.0
    step(sched, batch)  # the step took 1.0s
    sched.add(b)  # arrives at t=1.0
    now[0] = 1.2
    batch = sched.schedule()  # b waited 0.2s < 0.5 * 1.0s
    assert batch.seqs == [a] and sched.num_waiting == 1
    now[0] = 2.2
    step(sched, batch)
    batch = sched.schedule()  # b waited 1.2s: admitted
    assert batch.seqs == [a, b]
    step(sched, batch)
    sched.finish(a, "stop")
    sched.finish(b, "stop")
    sched.add(c)
    assert sched.schedule().seqs == [c]  # nothing running: no delay


def test_drafts_ride_with_their_decode_and_only_accepted_ones_count():
    """A decoding sequence with draft tokens (speculative decoding) computes its newest
    token plus the drafts, within the step budget; afterwards only the verified tokens
    (newest + accepted drafts) count as computed."""
    sched = make_scheduler(num_blocks=64, max_tokens_per_step=16)
    a, b = make_seq(list(range(6)), max_tokens=8), make_seq(list(range(5)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prompts
    a.spec_tokens = [7, 8, 9]
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_scheduled_tokens == [4, 1]
    assert batch.drafts == [[7, 8, 9], []] and batch.sample_mask == [True, True]
    assert len(a.block_table) * BS >= a.num_computed_tokens + 4
    before = a.num_computed_tokens
    a.token_ids += [7, 42]  # one draft accepted, then the target's own token
    b.token_ids.append(5)
    sched.advance(batch, {a.seq_id: 1})
    assert a.num_computed_tokens == before + 2 and b.num_computed_tokens == 6
    # A budget smaller than the drafts trims them (the newest token always fits).
    sched = make_scheduler(num_blocks=64, max_tokens_per_step=3)
    c = make_seq(list(range(2)), max_tokens=8)
    sched.add(c)
    step(sched)
    c.spec_tokens = [1, 2, 3, 4]
    batch = sched.schedule()
    assert batch.num_scheduled_tokens == [3] and batch.drafts == [[1, 2]]


def test_lookahead_slots_only_past_steps_that_sample():
    """With a draft network (lookahead k) a step that samples allocates k slots past its
    tokens for the network's writes; a chunk short of its prompt's end does not, and the
    lookahead stops at --max-model-len."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6)
    sched = Scheduler(config, BlockManager(64, BS, enable_prefix_caching=False), 16,
                      lookahead=3)
    a = make_seq(list(range(10)), max_tokens=8)
    sched.add(a)
    batch = step(sched)  # the first 6-token chunk: no sample, no lookahead
    assert batch.sample_mask == [False] and len(a.block_table) == 2
    batch = step(sched)  # the last 4 prompt tokens, sampled: 10 + 3 slots
    assert batch.sample_mask == [True] and len(a.block_table) == 4
    a.spec_tokens = [1, 2]
    batch = sched.schedule()  # 11 tokens + 2 drafts = 13 computed, 3 ahead, capped at 16
    assert batch.num_scheduled_tokens == [3] and len(a.block_table) == 4
    a.token_ids += [1, 2, 3]
    sched.advance(batch, {a.seq_id: 2})
    a.spec_tokens = [4]
    batch = sched.schedule()  # 14 + 1 draft = 15 slots: the lookahead stops at 16
    assert batch.num_scheduled_tokens == [2] and len(a.block_table) == 4
