"""The whole engine against Hugging Face transformers on the same (tiny, random) weights.

32 greedy tokens for 4 prompts of different lengths, batched, must equal transformers
token for token — with prefix caching on and off, with prefills chunked by a small token
budget, and with a KV pool small enough to force preemption by recompute.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams
from tests.tiny_models import tiny_model_dir

KINDS = ["llama", "qwen3"]
NEW_TOKENS = 32


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(20)]  # a common prefix, for prefix-cache hits
    return [
        shared[:7],
        shared + [rng.randrange(vocab) for _ in range(13)],
        [rng.randrange(vocab) for _ in range(45)],
        shared + [rng.randrange(vocab) for _ in range(3)],
    ]


@pytest.fixture(scope="module", params=KINDS)
def reference(request):
    """(model dir, prompts, transformers' greedy continuations) for one architecture."""
    path = tiny_model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)
    outs = []
    with torch.inference_mode():
        for p in ps:
            ids = torch.tensor([p])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )
            outs.append(out[0, len(p):].tolist())
    return path, ps, outs


SETTINGS = {
    "plain": {},
    "prefix_caching": {"enable_prefix_caching": True},
    "chunked_prefill": {"max_num_batched_tokens": 16, "enable_prefix_caching": True},
    "preemption": {"num_gpu_blocks_override": 24, "block_size": 4, "max_model_len": 96},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_identical_to_transformers(reference, setting):
    path, ps, expected = reference
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu", **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if setting == "prefix_caching":
        engine.generate([ps[0] + ps[1][7:]], params)  # warm the cache with the shared prefix
    outs = engine.generate(ps, params)
    assert [o["token_ids"] for o in outs] == expected
    assert all(o["finish_reason"] == "length" for o in outs)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    if setting == "preemption":
        assert engine.num_preemptions > 0
    if setting == "prefix_caching":
        assert engine.block_manager.prefix_cache_hit_rate > 0


def test_prefill_logits_match_transformers(reference):
    path, ps, _ = reference
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
    outs = engine.generate(ps, params)
    with torch.inference_mode():
        for p, out in zip(ps, outs):
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            got = torch.tensor([e.logprob for e in out["prompt_logprobs"][1:]])
            want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            last = out["logprobs"][0]
            assert last.token_id == int(ref[-1].argmax())
            assert abs(last.logprob - float(ref[-1].max())) < 1e-4
            top_ids = [t for t, _ in last.top]
            assert top_ids == ref[-1].topk(5).indices.tolist()
