"""MiniMax-M2 through the real LLMEngine against transformers' greedy generate: 32 tokens for
4 prompts of different lengths, batched, identical token for token -- with prefix caching
and chunked prefill -- and prompt logprobs within 1e-4."""

from __future__ import annotations

import pytest

from atom_core import LLMEngine, SamplingParams
from atom_core.testing.engine_reference import (
    NEW_TOKENS,
    SETTINGS,
    check_prompt_logprobs,
    hf_greedy,
    hf_model,
    prompts,
    warm_prefix,
)
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    path = tiny_model_dir("minimax_m2")
    hf = hf_model(path)
    ps = prompts(hf.config.vocab_size)
    return path, ps, hf_greedy(hf, ps), hf


def engine(path) -> LLMEngine:
    return LLMEngine(str(path), enable_log_stats=False, device="cpu",
                     **SETTINGS["chunked_prefill"])


def test_greedy_tokens_identical_to_transformers(reference):
    path, ps, expected, _ = reference
    eng = engine(path)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    eng.generate([warm_prefix(ps)], params)
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == expected
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks
    assert eng.block_manager.prefix_cache_hit_rate > 0


def test_prefill_logits_match_transformers(reference):
    path, ps, _, hf = reference
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
    check_prompt_logprobs(hf, ps, engine(path).generate(ps, params))
