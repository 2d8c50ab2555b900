"""Rejection sampler: greedy verification, exactness of the emitted distribution, seed
isolation and logprobs."""

from __future__ import annotations

import pytest
import torch

from atom_core.spec_decode.rejection import rejection_sample

try:
    from scipy.stats import chisquare
except ImportError:  # pragma: no cover - scipy is in the dev environment
    chisquare = None

VOCAB = 16
CHI2_CRITICAL_1PCT_15DOF = 30.578

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def peaked(argmaxes: list[int], vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """[len(argmaxes), vocab] probabilities with a clear maximum at each given token."""
    logits = torch.randn(len(argmaxes), vocab, generator=gen(seed))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits.softmax(dim=-1)


def random_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=gen(seed)) * 1.5).softmax(dim=-1)


def emitted(out, s: int) -> list[int]:
    return out.token_ids[s, : int(out.num_tokens[s])].tolist()


def assert_distributed_as(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit at 1%, 15 degrees of freedom."""
    probs = probs.double()
    expected = probs / probs.sum() * counts.sum()
    if chisquare is not None:
        pvalue = chisquare(counts.double().numpy(), expected.numpy()).pvalue
        assert pvalue > 0.01, f"chi-square p-value {pvalue:.2e}"
    else:
        stat = float(((counts.double() - expected) ** 2 / expected).sum())
        assert stat < CHI2_CRITICAL_1PCT_15DOF, f"chi-square statistic {stat:.1f}"


def distribution_fixture() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target p, draft q and a different bonus-row target, fixed and far enough apart that
    confusing any two of them fails the chi-square test."""
    p = random_probs(1, VOCAB, seed=1)[0]
    q = random_probs(1, VOCAB, seed=2)[0]
    bonus = random_probs(1, VOCAB, seed=3)[0]
    return p, q, bonus


# --- greedy -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_accepts_prefix_then_corrects_with_target_argmax(device):
    # Target argmaxes 5, 7, 2, 9; drafts 5, 7, 3: two accepted, the third corrected to 2.
    probs = peaked([5, 7, 2, 9]).to(device)
    out = rejection_sample(probs, torch.tensor([5, 7, 3], device=device), [3], greedy=[True])
    assert emitted(out, 0) == [5, 7, 2]
    assert out.num_accepted.tolist() == [2]
    assert out.token_ids[0].tolist() == [5, 7, 2, -1]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_all_accepted_emits_bonus_argmax_of_last_row(device):
    probs = peaked([5, 7, 2, 9]).to(device)
    out = rejection_sample(probs, torch.tensor([5, 7, 2], device=device), [3], greedy=[True])
    assert emitted(out, 0) == [5, 7, 2, 9]
    assert out.num_accepted.tolist() == [3]


def test_greedy_first_draft_rejected_emits_one_token():
    probs = peaked([5, 7, 2, 9])
    out = rejection_sample(probs, torch.tensor([4, 7, 2]), [3], greedy=[True])
    assert emitted(out, 0) == [5]
    assert out.num_accepted.tolist() == [0]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_mixed_draft_lengths_including_plain_decode(device):
    # Sequences: k=0 (argmax 3), k=2 all accepted (1, 4, bonus 6), k=0 (argmax 8),
    # k=3 rejected at position 1 (drafts 11, 0, 12; target 11, 13, ...), k=1 rejected.
    argmaxes = [3, 1, 4, 6, 8, 11, 13, 12, 2, 10, 15]
    drafts = [1, 4, 11, 0, 12, 9]
    probs = peaked(argmaxes).to(device)
    out = rejection_sample(
        probs, torch.tensor(drafts, device=device), [0, 2, 0, 3, 1], greedy=[True] * 5
    )
    assert [emitted(out, s) for s in range(5)] == [[3], [1, 4, 6], [8], [11, 13], [10]]
    assert out.num_accepted.tolist() == [0, 2, 0, 1, 0]
    assert out.num_tokens.tolist() == [1, 3, 1, 2, 1]
    assert out.token_ids.shape == (5, 4)
    assert out.token_ids[0].tolist() == [3, -1, -1, -1]


def test_greedy_sequences_ignore_draft_probs_and_randomness_in_a_mixed_batch():
    # Greedy verification looks only at the target's argmax: next to a sampled sequence,
    # with a flat q and any global seed, the greedy sequence's tokens never change.
    argmaxes = [5, 7, 9, 1, 2]
    probs = peaked(argmaxes)
    draft_probs = torch.full((3, VOCAB), 1.0 / VOCAB)
    for seed in range(5):
        torch.manual_seed(seed)
        out = rejection_sample(
            probs,
            torch.tensor([5, 7, 0]),
            [2, 1],
            draft_probs=draft_probs,
            greedy=[True, False],
        )
        assert emitted(out, 0) == [5, 7, 9]


def test_all_zero_draft_batch_is_plain_sampling():
    probs = peaked([4, 9, 13])
    out = rejection_sample(probs, torch.empty(0, dtype=torch.long), [0, 0, 0], greedy=[True] * 3)
    assert out.token_ids.tolist() == [[4], [9], [13]]
    assert out.num_accepted.tolist() == [0, 0, 0]


# --- distribution -----------------------------------------------------------------------

N_DRAWS = 200_000


def test_emitted_distribution_is_target_and_acceptance_matches_theory():
    p, q, bonus = distribution_fixture()
    torch.manual_seed(0)
    drafts = torch.multinomial(q, N_DRAWS, replacement=True, generator=gen(4))
    target = torch.stack([p, bonus]).repeat(N_DRAWS, 1)  # rows: p, bonus, p, bonus, ...
    out = rejection_sample(target, drafts, [1] * N_DRAWS, draft_probs=q.expand(N_DRAWS, -1))

    first = torch.bincount(out.token_ids[:, 0], minlength=VOCAB)
    assert_distributed_as(first, p)
    # The test has power: the same counts do not pass as the draft's distribution.
    with pytest.raises(AssertionError):
        assert_distributed_as(first, q)

    rate = out.num_accepted.double().mean().item()
    expected_rate = torch.minimum(p, q).sum().item()
    assert abs(rate - expected_rate) < 0.005  # ~4.5 standard errors

    # After an accepted draft, the bonus token comes from the last row's distribution.
    accepted = out.num_accepted == 1
    assert (out.num_tokens == out.num_accepted + 1).all()
    assert (out.token_ids[accepted, 0] == drafts[accepted]).all()
    assert_distributed_as(torch.bincount(out.token_ids[accepted, 1], minlength=VOCAB), bonus)
    assert (out.token_ids[~accepted, 1] == -1).all()


def test_second_draft_is_verified_against_its_own_row():
    # k=2 with a distinct p_j and q_j per position: given the first draft is accepted, the
    # second emitted token must follow p_1 (not p_0 or the bonus row).
    n = 60_000
    p0, q0, _ = distribution_fixture()
    p1, q1, bonus = random_probs(3, VOCAB, seed=5)
    drafts = torch.stack(
        [
            torch.multinomial(q0, n, replacement=True, generator=gen(6)),
            torch.multinomial(q1, n, replacement=True, generator=gen(7)),
        ],
        dim=1,
    ).reshape(-1)
    target = torch.stack([p0, p1, bonus]).repeat(n, 1)
    draft_probs = torch.stack([q0, q1]).repeat(n, 1)
    torch.manual_seed(1)
    out = rejection_sample(target, drafts, [2] * n, draft_probs=draft_probs)
    second = out.token_ids[out.num_accepted >= 1, 1]
    assert_distributed_as(torch.bincount(second, minlength=VOCAB), p1)


def test_one_hot_draft_emits_target_distribution():
    # q=None: a deterministic draft. Drafts cycle through the vocabulary; whatever the draft,
    # the first emitted token is distributed as p and the draft is accepted w.p. p(x).
    p, _, bonus = distribution_fixture()
    drafts = torch.arange(N_DRAWS) % VOCAB
    target = torch.stack([p, bonus]).repeat(N_DRAWS, 1)
    torch.manual_seed(2)
    out = rejection_sample(target, drafts, [1] * N_DRAWS)

    first = torch.bincount(out.token_ids[:, 0], minlength=VOCAB)
    assert_distributed_as(first, p)
    rate = out.num_accepted.double().mean().item()
    assert abs(rate - p.mean().item()) < 0.005

    # Per draft token too: rejection never re-emits the rejected token.
    x = 3
    rows = drafts == x
    rejected = rows & (out.num_accepted == 0)
    assert (out.token_ids[rejected, 0] != x).all()
    assert_distributed_as(torch.bincount(out.token_ids[rows, 0], minlength=VOCAB), p)


def test_empty_residual_falls_back_to_target():
    # p = q / 2 on tokens {3, 5}: drafts are rejected half the time and max(0, p - q) is
    # zero everywhere; the corrected token must still come from p's support.
    q = torch.zeros(VOCAB)
    q[3], q[5] = 0.25, 0.75
    p = q / 2
    n = 2_000
    drafts = torch.multinomial(q, n, replacement=True, generator=gen(8))
    target = torch.stack([p, p]).repeat(n, 1)
    torch.manual_seed(3)
    out = rejection_sample(target, drafts, [1] * n, draft_probs=q.expand(n, -1))
    assert (out.num_accepted == 0).any()
    assert torch.isin(out.token_ids[:, :1], torch.tensor([3, 5])).all()


# --- seeds ------------------------------------------------------------------------------


def seeded_batch(device: str, seeds: list[int | None], ks: list[int], seed: int = 0):
    """Random target/draft probabilities for sequences with the given draft lengths, and
    drafts sampled from the draft probabilities; each sequence's inputs depend only on
    (seed, its position in ``ks``), so a sequence can be rebuilt inside another batch."""
    vocab = 32
    target, drafts, draft_probs = [], [], []
    for s, k in enumerate(ks):
        target.append(random_probs(k + 1, vocab, seed=1000 * seed + 2 * s))
        q = random_probs(k, vocab, seed=1000 * seed + 2 * s + 1)
        draft_probs.append(q)
        if k:
            drafts.append(torch.multinomial(q, 1, generator=gen(s)).reshape(-1))
    gens = [None if x is None else gen(x, device) for x in seeds]
    return (
        torch.cat(target).to(device),
        torch.cat(drafts).to(device) if drafts else torch.empty(0, dtype=torch.long),
        torch.cat(draft_probs).to(device),
        gens,
    )


def rows_of(out, s: int) -> tuple[list[int], float]:
    return emitted(out, s), float(out.logprobs[s, : int(out.num_tokens[s])].sum())


@pytest.mark.parametrize("device", DEVICES)
def test_same_seeds_reproduce(device):
    ks = [3, 0, 2, 4]
    results = []
    for _ in range(2):
        target, drafts, dprobs, gens = seeded_batch(device, [11, 12, 13, 14], ks)
        torch.manual_seed(len(results))  # the unseeded stream differs between the runs
        out = rejection_sample(target, drafts, ks, draft_probs=dprobs, generators=gens)
        results.append(out.token_ids.tolist())
    assert results[0] == results[1]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sequence_does_not_depend_on_the_batch(device):
    # The same inputs for one sequence, alone and at position 2 of a larger batch.
    ks = [3, 1, 2, 0]
    target, drafts, dprobs, gens = seeded_batch(device, [5, None, 7, None], ks)
    torch.manual_seed(0)
    big = rejection_sample(target, drafts, ks, draft_probs=dprobs, generators=gens)

    row_start, draft_start = sum(k + 1 for k in ks[:2]), sum(ks[:2])
    alone = rejection_sample(
        target[row_start : row_start + 3],
        drafts[draft_start : draft_start + 2],
        [2],
        draft_probs=dprobs[draft_start : draft_start + 2],
        generators=[gen(7, device)],
    )
    assert rows_of(alone, 0) == rows_of(big, 2)


def test_seed_controls_the_outcome():
    # Different seeds give different outcomes (so the reproduction tests are not trivial),
    # and a greedy sequence's generator is left untouched.
    ks = [4]
    outcomes = set()
    for seed in range(30):
        target, drafts, dprobs, gens = seeded_batch("cpu", [seed], ks)
        out = rejection_sample(target, drafts, ks, draft_probs=dprobs, generators=gens)
        outcomes.add(tuple(emitted(out, 0)))
    assert len(outcomes) > 5

    g = gen(9)
    before = g.get_state()
    target, drafts, dprobs, _ = seeded_batch("cpu", [None], ks)
    rejection_sample(target, drafts, ks, draft_probs=dprobs, greedy=[True], generators=[g])
    assert torch.equal(g.get_state(), before)


# --- logprobs and inputs ----------------------------------------------------------------


@pytest.mark.parametrize("greedy", [False, True])
def test_logprobs_are_log_target_prob_of_each_emitted_token(greedy):
    ks = [2, 0, 3, 1]
    target, drafts, dprobs, _ = seeded_batch("cpu", [None] * 4, ks, seed=3)
    torch.manual_seed(4)
    out = rejection_sample(target, drafts, ks, draft_probs=dprobs, greedy=[greedy] * 4)
    row = 0
    for s, k in enumerate(ks):
        n = int(out.num_tokens[s])
        for j in range(k + 1):
            if j < n:
                token = int(out.token_ids[s, j])
                want = torch.log(target[row + j, token])
                torch.testing.assert_close(out.logprobs[s, j], want)
            else:
                assert out.logprobs[s, j] == float("-inf")
        row += k + 1
    assert (out.logprobs[1, 1:] == float("-inf")).all()


def test_rejects_inconsistent_shapes():
    probs = peaked([1, 2, 3])
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(probs, torch.tensor([1, 2]), [2, 1])
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(probs, torch.tensor([1]), [2])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(probs, torch.tensor([1, 2]), [2], draft_probs=probs)
    with pytest.raises(ValueError, match="one entry per sequence"):
        rejection_sample(probs, torch.tensor([1, 2]), [2], greedy=[True, False])
