"""The whole engine against Hugging Face transformers on the same (tiny, random) weights.

32 greedy tokens for 4 prompts of different lengths, batched, must equal transformers
token for token — with prefix caching on and off, with prefills chunked by a small token
budget, and with a KV pool small enough to force preemption by recompute.
"""

from __future__ import annotations

import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams
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

KINDS = ["llama", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def reference(request):
    """(model dir, prompts, transformers' greedy continuations, HF model) for one architecture."""
    path = tiny_model_dir(request.param)
    hf = hf_model(path)
    ps = prompts(hf.config.vocab_size)
    return path, ps, hf_greedy(hf, ps), hf


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_identical_to_transformers(reference, setting):
    path, ps, expected, _ = reference
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu", **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if setting == "prefix_caching":
        engine.generate([warm_prefix(ps)], params)
    outs = engine.generate(ps, params)
    assert [o["token_ids"] for o in outs] == expected
    assert all(o["finish_reason"] == "length" for o in outs)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    if setting == "preemption":
        assert engine.num_preemptions > 0
    if setting == "prefix_caching":
        assert engine.block_manager.prefix_cache_hit_rate > 0


def test_prefill_logits_match_transformers(reference):
    path, ps, _, hf = reference
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
    check_prompt_logprobs(hf, ps, engine.generate(ps, params))
