"""transformers as the reference for whole-engine tests: greedy continuations and prompt
logprobs computed by HF on the same weights, and the checks every model family shares."""

from __future__ import annotations

import random
from typing import Any

import torch
from transformers import AutoModelForCausalLM

NEW_TOKENS = 32

# Engine settings every architecture must pass identically.
SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "prefix_caching": {"enable_prefix_caching": True},
    "chunked_prefill": {"max_num_batched_tokens": 16, "enable_prefix_caching": True},
    "preemption": {"num_gpu_blocks_override": 24, "block_size": 4, "max_model_len": 96},
}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Four prompts of different lengths; three share a 20-token prefix (cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(20)]
    return [
        shared[:7],
        shared + [rng.randrange(vocab) for _ in range(13)],
        [rng.randrange(vocab) for _ in range(45)],
        shared + [rng.randrange(vocab) for _ in range(3)],
    ]


def warm_prefix(ps: list[list[int]]) -> list[int]:
    """A prompt that puts the shared prefix in the cache before the batch runs."""
    return ps[0] + ps[1][7:]


def hf_model(path: Any, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_greedy(hf: Any, ps: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (an explicit attention mask: a
    prompt token equal to pad_token_id must not be masked out)."""
    outs = []
    with torch.inference_mode():
        for p in ps:
            ids = torch.tensor([p], device=hf.device)
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
            )
            outs.append(out[0, len(p):].tolist())
    return outs


def check_prompt_logprobs(hf: Any, ps: list[list[int]], outs: list[dict], top: int = 5) -> None:
    """Engine prompt logprobs and the first sampled token's logprobs vs HF's, within 1e-4."""
    with torch.inference_mode():
        for p, out in zip(ps, outs):
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            got = torch.tensor([e.logprob for e in out["prompt_logprobs"][1:]])
            want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            last = out["logprobs"][0]
            assert last.token_id == int(ref[-1].argmax())
            assert abs(last.logprob - float(ref[-1].max())) < 1e-4
            assert [t for t, _ in last.top] == ref[-1].topk(top).indices.tolist()


def check_engine_against_transformers(path: Any, hf_path: Any = None) -> Any:
    """The family check through the real LLMEngine on the checkpoint at ``path`` (with
    transformers' model from ``hf_path``, default the same): greedy tokens for the shared
    prompts identical to transformers' generate with prefix caching and chunked prefill on
    (every block freed after, the prefix cache hit), then on a fresh engine prompt
    logprobs within 1e-4. Returns the first engine, for checks of the caller's own."""
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    hf = hf_model(hf_path or path)
    ps = prompts(hf.config.vocab_size)

    def engine() -> Any:
        return LLMEngine(str(path), enable_log_stats=False, device="cpu",
                         **SETTINGS["chunked_prefill"])

    eng = engine()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    eng.generate([warm_prefix(ps)], params)
    assert [o["token_ids"] for o in eng.generate(ps, params)] == hf_greedy(hf, ps)
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks
    assert eng.block_manager.prefix_cache_hit_rate > 0
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
    check_prompt_logprobs(hf, ps, engine().generate(ps, params))
    return eng


def staggered_generate(engine: Any, prompts: list[list[int]], params: list[Any],
                       every: int) -> list[list[int]]:
    """Each request's token ids, the requests arriving one per ``every`` engine steps, so
    prompts land beside running decodes (mixed steps)."""
    got: dict[str, list[int]] = {}

    def collect(out: Any) -> None:
        got.setdefault(out.request_id, []).extend(out.token_ids)

    rids = []
    for p, sp in zip(prompts, params, strict=True):
        rids += engine.add_request([p], sp, stream_callback=collect)
        for _ in range(every):
            engine.step()
    while not engine.is_finished():
        engine.step()
    return [got[r] for r in rids]
