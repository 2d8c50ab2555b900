"""SmolLM2 (the embedded model, real weights) with fp8 weights, then with an fp8 KV cache
too: the perplexity of a public-domain text against the unquantized model's, and how long
greedy decoding agrees with it.

The weights alone cost +2.5% here; with the cache too, its scales measured at start-up
(``--calculate-kv-scales``) over the whole calibration text, +2.3%, where every query reads
its K/V back from the e4m3 cache as the GPU kernels do. A 135M model whose weights come
from a Q4_1 GGUF, which per-channel e4m3 cannot represent exactly, is a hard case for fp8.
Scales measured on the calibration text's first 32 tokens alone (the token budget here)
clipped K in the layers where the least-error choice kept no headroom, and both together
cost +4.5%. A 173-token score moves by ~0.5% (one standard deviation) with the rounding of
the cache alone, so the figures are read against that: over ~3,600 tokens of this
repository's docs, fp8 weights cost +2.4% and weights + cache +3.2% to +3.4% whichever
way the scales were measured.

Greedy agreement is printed, not bounded: a small model's greedy continuation runs
through near-ties, where any rounding picks the other token (fp8 weights alone agree for
all 128 tokens after this prompt, for none after its first 300 characters).
"""

from __future__ import annotations

import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams
from tests.perplexity import CHUNKED, TEXT, perplexity

GREEDY = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)


def forced_agreement(engine: LLMEngine, prompt: list[int], want: list[int]) -> int:
    """How many of ``want`` (another engine's greedy continuation of ``prompt``) ``engine``
    would decode greedily before it first differs. Read in one pass over prompt + want: up
    to the first position where ``engine``'s argmax is not the token there, its greedy
    decoding would have seen the same context, so that position is where it would part
    (128 fp8 decode steps of reference ops take ~30 s on a 2-core VM)."""
    out = engine.generate([prompt + want], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ranks = [entry.rank for entry in out["prompt_logprobs"][len(prompt):]]
    assert len(ranks) == len(want)
    return next((i for i, rank in enumerate(ranks) if rank != 1), len(want))


@pytest.mark.slow
def test_smollm2_fp8_weights_and_cache_perplexity(smollm2_chunked, capsys):
    base_engine, base = smollm2_chunked
    weights = perplexity(LLMEngine(quantization="fp8", **CHUNKED), TEXT)
    fp8_engine = LLMEngine(quantization="fp8", kv_cache_dtype="fp8", calculate_kv_scales=True,
                           **CHUNKED)
    fp8 = perplexity(fp8_engine, TEXT)
    prompt = base_engine.tokenize(TEXT[:200])
    want = base_engine.generate([prompt], GREEDY)[0]["token_ids"]
    agreed = forced_agreement(fp8_engine, prompt, want)
    with capsys.disabled():
        print(f"\nSmolLM2 perplexity: {base:.2f} unquantized, {weights:.2f} fp8 weights "
              f"({weights / base - 1:+.1%}), {fp8:.2f} fp8 weights + fp8 KV "
              f"({fp8 / base - 1:+.1%}); greedy agreement {agreed}/128 tokens")
    assert weights == pytest.approx(base, rel=0.03), (base, weights)
    assert fp8 == pytest.approx(base, rel=0.03), (base, fp8)
    assert base != weights != fp8  # the weights, then the cache, did change
    assert 1.5 < base < 100  # a real model reading real text
    assert len(want) == 128
