"""The Triton ``rejection_sample`` vs the torch reference (the native op), on CPU through
TRITON_INTERPRET=1 or on a GPU when there is one: equal tokens, counts and logprobs over
random greedy, sampled and mixed batches (k = 0..5 per sequence, with and without draft
probabilities, vocabularies spanning several partial blocks, exact ties and zeros), the
empty-residual fallback, the same draws from the global generator, and seeded sequences
that reproduce and do not depend on their batch. Skipped where triton is not installed."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from atom_kernels_triton import rejection as triton_rejection  # noqa: E402
from atom_kernels_triton.hooks import triton_ops  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.spec_decode.rejection import RejectionOutput  # noqa: E402
from atom_core.spec_decode.rejection import rejection_sample as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    probs: torch.Tensor
    drafts: torch.Tensor
    ks: list[int]
    draft_probs: torch.Tensor | None
    greedy: list[bool]
    seeds: list[int | None]

    def run(self, fn, global_seed: int = 0) -> RejectionOutput:
        torch.manual_seed(global_seed)
        if DEVICE == "cuda":
            torch.cuda.manual_seed(global_seed)
        gens = [None if x is None else torch.Generator(DEVICE).manual_seed(x)
                for x in self.seeds]
        return fn(self.probs, self.drafts, self.ks, self.draft_probs, self.greedy, gens)


def make_case(seed: int, vocab: int, num_seqs: int, mode: str, with_q: bool,
              ties: bool = False, max_k: int = 5) -> Case:
    """A random batch whose drafts are often accepted, so every position gets verified.

    ``mode``: "greedy", "sampled" or "mixed" (each sequence either). The target rows are
    softmaxes of logits, integer ones with ``ties`` (many exactly equal probabilities), and
    a quarter of them keep only their top entries (exact zeros, as after top-k). A draft row
    q is its target row's logits perturbed; drafts are drawn from q, or from p for a one-hot
    q; a greedy sequence's draft is its row's argmax three times in four.
    """
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ks = [rng.randint(0, max_k) for _ in range(num_seqs)]
    greedy = [mode == "greedy" or (mode == "mixed" and rng.random() < 0.5) for _ in ks]
    seeds = [rng.choice([None, rng.randrange(10_000)]) for _ in ks]
    rows = sum(ks) + num_seqs
    if ties:
        logits = torch.randint(-3, 4, (rows, vocab), generator=g).float()
    else:
        # A favourite token per row holding ~3/4 of the mass at any vocabulary size (the
        # rest sums to ~V e^2), so drafts of either kind are often accepted.
        logits = torch.randn(rows, vocab, generator=g) * 2
        favourite = torch.randint(0, vocab, (rows,), generator=g)
        logits[torch.arange(rows), favourite] += 3 + math.log(vocab)
    for r in range(rows):
        if rng.random() < 0.25:
            keep = logits[r].topk(rng.randint(1, min(8, vocab))).values[-1]
            logits[r] = torch.where(logits[r] >= keep, logits[r], float("-inf"))
    probs = logits.softmax(dim=-1)

    drafts, draft_logits = [], []
    start = 0
    for s, k in enumerate(ks):
        for j in range(k):
            row_logits = logits[start + j]
            q_logits = row_logits + torch.randn(vocab, generator=g) * 0.5
            draft_logits.append(q_logits)
            dist = q_logits.softmax(dim=-1) if with_q else probs[start + j]
            if greedy[s] and rng.random() < 0.75:
                drafts.append(int(probs[start + j].argmax()))
            else:
                drafts.append(int(torch.multinomial(dist, 1, generator=g)))
        start += k + 1
    draft_probs = None
    if with_q:
        stacked = torch.stack(draft_logits) if draft_logits else torch.empty(0, vocab)
        draft_probs = stacked.softmax(dim=-1).to(DEVICE)
    return Case(probs.to(DEVICE), torch.tensor(drafts, dtype=torch.long, device=DEVICE), ks,
                draft_probs, greedy, seeds)


def assert_same(got: RejectionOutput, want: RejectionOutput) -> None:
    assert torch.equal(got.token_ids, want.token_ids), (got.token_ids, want.token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.num_tokens, want.num_tokens)
    assert got.logprobs.dtype == torch.float32
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)


def rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if DEVICE == "cuda" else torch.get_rng_state()


def check(case: Case, global_seed: int = 0) -> RejectionOutput:
    want = case.run(reference, global_seed)
    state = rng_state()
    got = case.run(triton_rejection.rejection_sample, global_seed)
    # The same draws from the global generator: its state afterwards is the same.
    assert torch.equal(rng_state(), state)
    assert_same(got, want)
    return got


@pytest.fixture
def small_block(monkeypatch):
    # A vocabulary of 1000 then spans eight blocks, the last one partial.
    monkeypatch.setattr(triton_rejection, "BLOCK", 128)


def test_registered():
    assert triton_ops()["rejection_sample"] is triton_rejection.rejection_sample
    assert resolve_op("rejection_sample", "cpu") is reference


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("with_q", [True, False])
def test_random_batches_match_the_reference(small_block, mode, with_q):
    outcomes = []
    for seed in range(6):
        case = make_case(seed, 1000, 6, mode, with_q)
        out = check(case, global_seed=seed)
        outcomes += zip(case.ks, out.num_accepted.tolist())
    # Not trivial: runs of three or more drafts all accepted, and rejections after an
    # accepted draft.
    assert any(a == k >= 3 for k, a in outcomes)
    assert any(0 < a < k for k, a in outcomes)


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("with_q", [True, False])
def test_exact_ties_and_zeros(small_block, mode, with_q):
    for seed in range(4):
        check(make_case(100 + seed, 333, 5, mode, with_q, ties=True), global_seed=seed)


@pytest.mark.parametrize("vocab", [1, 5, 127, 129])
def test_vocab_around_one_block(small_block, vocab):
    for seed, mode in enumerate(["greedy", "sampled", "mixed"]):
        check(make_case(200 + seed, vocab, 4, mode, with_q=seed % 2 == 0))


def test_greedy_ties_take_the_first_index(small_block):
    # Row maxima repeated across blocks, and a row of zeros: the lowest index wins.
    probs = torch.zeros(4, 1000)
    probs[0, [900, 300, 301]] = 0.25  # draft 300 accepted, then the zero row's bonus: 0
    probs[2, [5, 130]] = 0.5  # draft 130 rejected for 5
    case = Case(probs.to(DEVICE), torch.tensor([300, 130], device=DEVICE), [1, 1], None,
                [True, True], [None, None])
    out = check(case)
    assert out.token_ids.tolist() == [[300, 0], [5, -1]]
    assert out.num_accepted.tolist() == [1, 0]


@pytest.mark.parametrize("with_q", [True, False])
def test_empty_residual_falls_back_to_the_target(small_block, with_q):
    # The target's mass lies only where q's does, p <= q everywhere: max(0, p - q) (or p
    # without the one-hot draft) is empty and the final token is raced over p itself.
    vocab, n = 500, 64
    q = torch.zeros(vocab)
    q[[7, 450]] = 0.5
    p = q / 2 if with_q else torch.zeros(vocab).index_fill_(0, torch.tensor([450]), 0.5)
    case = Case(p.repeat(2 * n, 1).to(DEVICE), torch.full((n,), 450, device=DEVICE), [1] * n,
                q.repeat(n, 1).to(DEVICE) if with_q else None, [False] * n, [None] * n)
    out = check(case)
    rejected = out.num_accepted == 0
    assert rejected.any() and (~rejected).any()
    support = [7, 450] if with_q else [450]
    assert torch.isin(out.token_ids[:, 0], torch.tensor(support, device=DEVICE)).all()


def test_batches_without_drafts(small_block):
    for mode in ["greedy", "sampled", "mixed"]:
        case = make_case(300, 1000, 5, mode, with_q=False, max_k=0)
        out = check(case)
        assert out.token_ids.shape == (5, 1) and (out.num_tokens == 1).all()
    empty = Case(torch.rand(0, 10, device=DEVICE), torch.empty(0, dtype=torch.long,
                 device=DEVICE), [], None, [], [])
    assert check(empty).token_ids.shape == (0, 1)


def test_seeded_sequences_reproduce_and_ignore_the_batch(small_block):
    case = make_case(400, 1000, 6, "sampled", with_q=True)
    case.seeds = [11, None, 12, 13, None, 14]
    first = check(case, global_seed=1)
    again = case.run(triton_rejection.rejection_sample, global_seed=2)
    seeded = [s for s, x in enumerate(case.seeds) if x is not None]
    assert again.token_ids[seeded].tolist() == first.token_ids[seeded].tolist()

    # Sequence 2 alone gets the tokens it got inside the batch.
    rows = sum(k + 1 for k in case.ks[:2])
    drafts = sum(case.ks[:2])
    k = case.ks[2]
    alone = Case(case.probs[rows : rows + k + 1], case.drafts[drafts : drafts + k], [k],
                 case.draft_probs[drafts : drafts + k], [False], [12])
    out = check(alone, global_seed=3)
    assert out.token_ids[0, : k + 1].tolist() == first.token_ids[2, : k + 1].tolist()


def test_seed_changes_the_outcome(small_block):
    case = make_case(500, 1000, 8, "sampled", with_q=True)
    outcomes = set()
    for seed in range(6):
        case.seeds = [seed] * 8
        outcomes.add(tuple(check(case).token_ids.flatten().tolist()))
    assert len(outcomes) == 6


def test_strided_rows_and_other_dtypes_match(small_block):
    case = make_case(600, 1000, 4, "mixed", with_q=True)
    wide = torch.zeros(case.probs.shape[0], 1200, device=DEVICE)
    wide[:, :1000] = case.probs
    case.probs = wide[:, :1000]  # rows of stride 1200
    check(case)
    # Other dtypes go to the reference, whose rounding in that dtype the kernel skips.
    case.probs = case.probs.double()
    case.draft_probs = case.draft_probs.double()
    check(case)


def test_bad_shapes_are_refused():
    probs = torch.rand(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        triton_rejection.rejection_sample(probs, torch.tensor([1, 2], device=DEVICE), [2, 1])
    with pytest.raises(ValueError, match="one entry per sequence"):
        triton_rejection.rejection_sample(probs, torch.tensor([1, 2], device=DEVICE), [2],
                                          greedy=[True, False])
