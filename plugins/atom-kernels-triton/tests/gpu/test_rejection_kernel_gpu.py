"""The Triton ``rejection_sample`` against the torch reference on the GPU: equal tokens,
counts and logprobs over random greedy, sampled and mixed batches at real vocabulary sizes
(none a multiple of every block), exact ties and zeros, and every block/warp shape timed;
the op resolves to the kernel on CUDA. Prints kernel vs reference times (CUDA events) at
32 sequences x 3 drafts over Qwen3's 151,936 tokens; nothing asserts on them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_kernels_triton import rejection as triton_rejection  # noqa: E402
from test_rejection_kernel import check, make_case  # noqa: E402

from atom_core.ops import resolve_op  # noqa: E402
from atom_core.spec_decode.rejection import draw_random  # noqa: E402
from atom_core.spec_decode.rejection import rejection_sample as reference  # noqa: E402

MODES = ["greedy", "sampled", "mixed"]


def test_resolves_to_the_kernel():
    assert resolve_op("rejection_sample", "cuda") is triton_rejection.rejection_sample


@pytest.mark.parametrize("vocab", [1000, 49152, 50257])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_q", [True, False])
def test_random_batches_match_the_reference(vocab, mode, with_q):
    outcomes = []
    for seed in range(8):
        case = make_case(seed, vocab, 16, mode, with_q)
        out = check(case, global_seed=seed)
        outcomes += zip(case.ks, out.num_accepted.tolist())
    assert any(a == k >= 3 for k, a in outcomes)
    assert any(0 < a < k for k, a in outcomes)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_q", [True, False])
def test_exact_ties_and_zeros(mode, with_q):
    for seed in range(4):
        check(make_case(100 + seed, 50257, 12, mode, with_q, ties=True), global_seed=seed)


def test_seeded_batches_at_full_vocabulary():
    case = make_case(7, 151936, 32, "mixed", with_q=True)
    case.seeds = list(range(32))
    check(case)


def batch(mode: str, with_q: bool) -> tuple:
    """S=32 sequences of K=3 drafts over V=151,936, drafts accepted about half the time."""
    num_seqs, k, vocab = 32, 3, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(num_seqs * (k + 1), vocab, device="cuda", generator=g) * 2
    probs = logits.softmax(dim=-1)
    draft_probs = (logits.view(num_seqs, k + 1, vocab)[:, :k].reshape(-1, vocab)
                   + torch.randn(num_seqs * k, vocab, device="cuda", generator=g)).softmax(-1)
    drafts = torch.multinomial(draft_probs, 1, generator=g).view(-1)
    return (probs, drafts, [k] * num_seqs, draft_probs if with_q else None,
            [mode == "greedy"] * num_seqs, [None] * num_seqs)


def time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


@pytest.mark.parametrize("mode,with_q", [("sampled", True), ("sampled", False),
                                         ("greedy", False)])
def test_timing(monkeypatch, mode, with_q):
    args = batch(mode, with_q)
    probs, _, ks, _, greedy, gens = args
    name = f"{mode}{' q' if with_q else ''}"
    defaults = (triton_rejection.BLOCK, triton_rejection.NUM_WARPS)
    draws = time_us(lambda: draw_random(ks, greedy, gens, probs.shape[1], probs.device))
    ref = time_us(lambda: reference(*args))
    print(f"\nrejection_sample S=32 K=3 V=151936 {name} on {torch.cuda.get_device_name()}: "
          f"reference {ref:.1f} us, draws alone {draws:.1f} us")
    for block, warps in [(1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16)]:
        monkeypatch.setattr(triton_rejection, "BLOCK", block)
        monkeypatch.setattr(triton_rejection, "NUM_WARPS", warps)
        torch.manual_seed(1)
        want = reference(*args)
        torch.manual_seed(1)
        got = triton_rejection.rejection_sample(*args)
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.num_accepted, want.num_accepted)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)
        kernel = time_us(lambda: triton_rejection.rejection_sample(*args))
        default = " (default)" if (block, warps) == defaults else ""
        print(f"  kernel BLOCK={block} warps={warps}{default}: {kernel:.1f} us "
              f"({ref / kernel:.1f}x the reference)")
