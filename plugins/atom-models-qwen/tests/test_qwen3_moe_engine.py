"""Qwen3-MoE through the real LLMEngine against transformers' greedy generate: 32 tokens for
4 prompts of different lengths, batched, identical token for token -- with prefix
caching and chunked prefill -- and prompt logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams
from tests.engine.test_engine_vs_transformers import NEW_TOKENS, SETTINGS, prompts
from tests.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def reference():
    path = tiny_model_dir("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)
    outs = []
    with torch.inference_mode():
        for p in ps:
            ids = torch.tensor([p])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None,
            )
            outs.append(out[0, len(p):].tolist())
    return path, ps, outs, hf


def test_greedy_tokens_identical_to_transformers(reference):
    path, ps, expected, _ = reference
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu", **SETTINGS["chunked_prefill"])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.generate([ps[0] + ps[1][7:]], params)  # warm the cache with the shared prefix
    outs = engine.generate(ps, params)
    assert [o["token_ids"] for o in outs] == expected
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    assert engine.block_manager.prefix_cache_hit_rate > 0


def test_prefill_logits_match_transformers(reference):
    path, ps, _, hf = reference
    engine = LLMEngine(
        str(path), enable_log_stats=False, device="cpu", enable_prefix_caching=True,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
    outs = engine.generate(ps, params)
    with torch.inference_mode():
        for p, out in zip(ps, outs):
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            got = torch.tensor([e.logprob for e in out["prompt_logprobs"][1:]])
            want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            assert out["logprobs"][0].token_id == int(ref[-1].argmax())
