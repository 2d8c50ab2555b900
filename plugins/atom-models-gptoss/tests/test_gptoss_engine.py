"""gpt-oss through the real LLMEngine against transformers' greedy generate: 32 tokens for
4 prompts of different lengths (three past the sliding window), batched, identical token
for token with prefix caching and chunked prefill on; for the MXFP4 checkpoint also the
prompt logprobs within 1e-4."""

from __future__ import annotations

import pytest
from tiny_gptoss import SLIDING_WINDOW, hf_model, tiny_dir

from atom_core import LLMEngine, SamplingParams
from atom_core.testing.engine_reference import (
    NEW_TOKENS,
    SETTINGS,
    check_prompt_logprobs,
    hf_greedy,
    prompts,
    warm_prefix,
)

_hf: dict = {}


def reference(variant: str):
    """(transformers' model, the prompts) of a variant, once per module."""
    if variant not in _hf:
        hf = hf_model(variant)
        _hf[variant] = hf, prompts(hf.config.vocab_size)
    return _hf[variant]


def engine(variant: str) -> LLMEngine:
    return LLMEngine(str(tiny_dir(variant)), enable_log_stats=False, device="cpu",
                     **SETTINGS["chunked_prefill"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16", "mxfp4"])
def test_greedy_tokens_identical_to_transformers(variant):
    hf, ps = reference(variant)
    assert sum(len(p) > SLIDING_WINDOW for p in ps) == 3
    eng = engine(variant)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    eng.generate([warm_prefix(ps)], params)
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == hf_greedy(hf, ps)
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks
    assert eng.block_manager.prefix_cache_hit_rate > 0


@pytest.mark.slow
def test_prompt_logprobs_match_transformers():
    hf, ps = reference("mxfp4")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
    check_prompt_logprobs(hf, ps, engine("mxfp4").generate(ps, params))
