"""The sampler under a token bitmask: constrained rows sample only allowed tokens on every
path (greedy, temperature, penalties, top-k/top-p), unconstrained rows are untouched, and
logprobs stay the model's."""

from __future__ import annotations

import torch

from atom_core.layers.sampler import Sampler, SamplingBatch, _allowed, _allowed_by_shifts
from atom_core.sampling_params import SamplingParams
from atom_core.structured import StructuredSpec

VOCAB = 100
SPEC = StructuredSpec("regex", "a")  # the sampler reads only whether a row has one
sampler = Sampler()


def bitmask(allowed_rows: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(len(allowed_rows), (VOCAB + 31) // 32, dtype=torch.int32)
    for i, tokens in enumerate(allowed_rows):
        for t in tokens:
            out[i, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return out


def build(params: list[SamplingParams], seeds: list[int | None] | None = None) -> SamplingBatch:
    n = len(params)
    gens = [None if s is None else torch.Generator().manual_seed(s)
            for s in (seeds or [None] * n)]
    return SamplingBatch.build(params, [[1, 2]] * n, [[3]] * n, gens, "cpu")


def test_unconstrained_batches_carry_nothing():
    batch = build([SamplingParams(), SamplingParams(temperature=0)])
    assert batch.constrained == [] and batch.constrained_rows is None
    assert batch.token_bitmask is None


def test_greedy_rows_take_the_best_allowed_token_and_others_are_untouched():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, structured=SPEC), SamplingParams(temperature=0),
              SamplingParams(temperature=0, structured=SPEC)]
    batch = build(params)
    assert batch.constrained == [0, 2] and batch.constrained_rows.tolist() == [0, 2]
    allowed = [[5, 17, 64], [99]]
    before = logits.clone()
    out = sampler(logits, batch.with_bitmask(bitmask(allowed)))
    ids = out.token_ids.tolist()
    assert ids[0] == max(allowed[0], key=lambda t: logits[0, t].item())
    assert ids[1] == logits[1].argmax().item()
    assert ids[2] == 99
    assert torch.equal(logits, before)  # the model's logits are not written
    assert batch.token_bitmask is None  # the reused batch does not keep a step's mask


def test_sampled_rows_with_filters_and_penalties_stay_inside_the_mask():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.5, top_k=50, top_p=0.9, repetition_penalty=1.3,
                             presence_penalty=0.5, structured=SPEC)] * 4
    allowed = [[3], [0, 1, 2, 3, 4], list(range(40, 100, 7)), [31, 32, 33]]
    batch = build(params, seeds=[None, 1, 2, None]).with_bitmask(bitmask(allowed))
    for _ in range(20):
        ids = sampler(logits, batch).token_ids.tolist()
        assert all(t in a for t, a in zip(ids, allowed))


def test_logprobs_are_the_models_not_the_masks():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    batch = build([SamplingParams(temperature=0, logprobs=3, structured=SPEC)])
    out = sampler(logits, batch.with_bitmask(bitmask([[7]])))
    lp = out.logprobs[0]
    assert lp.token_id == 7
    assert abs(lp.logprob - torch.log_softmax(logits[0], -1)[7].item()) < 1e-5
    assert [t for t, _ in lp.top] == logits[0].topk(3).indices.tolist()


def test_the_host_and_device_unpackings_agree():
    # The CPU unpacks with numpy, a GPU with shifts; both read bit t % 32 of word t // 32,
    # the sign bit included.
    words = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(3))
    for vocab in (128, 100, 97):
        expected = torch.tensor([[bool((int(words[r, t // 32]) >> (t % 32)) & 1)
                                  for t in range(vocab)] for r in range(5)])
        assert torch.equal(_allowed(words, vocab), expected)
        assert torch.equal(_allowed_by_shifts(words, vocab), expected)
