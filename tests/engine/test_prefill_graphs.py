"""Prefill graphs' padded inputs: a step of one sequence's prompt runs over static buffers
padded to a captured size. On CPU the same padded inputs run eagerly (no graphs), so the
padding, the last-row LM head and the cache writes are checked here against the plain
engine and transformers; the graphs themselves replay on a GPU (the Triton plugin's GPU
tests and bench/serving_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

from atom_core.engine.llm_engine import LLMEngine
from atom_core.engine.prefill_graphs import SLOTS
from atom_core.sampling_params import SamplingParams
from atom_core.testing.engine_reference import hf_greedy, hf_model
from atom_core.testing.tiny_models import tiny_model_dir

SIZES = [16, 32, 64]


def engine(padded: bool, **kw) -> LLMEngine:
    eng = LLMEngine(str(tiny_model_dir("qwen3")), enable_log_stats=False, device="cpu",
                    block_size=4, prefill_cudagraph_sizes=SIZES, **kw)
    eng.runner.fast_decode = True
    eng.runner._setup_fast_decode()
    if padded:
        eng.runner._setup_prefill_graphs(use_graphs=False)
    return eng


def count_lone_prefills(eng: LLMEngine) -> list[int]:
    """The token count of each step that took the prefill-graph path."""
    seen: list[int] = []
    launch = eng.runner._launch_prefill

    def spy(batch):
        seen.append(batch.num_scheduled_tokens[0])
        return launch(batch)

    eng.runner._launch_prefill = spy
    return seen


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_lone_prompts_padded_equal_eager_and_transformers(async_scheduling):
    ps = prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng = engine(True, async_scheduling=async_scheduling)
    lone = count_lone_prefills(eng)
    outs = [eng.generate([p], params)[0]["token_ids"] for p in ps]  # one at a time: alone
    assert sorted(lone) == sorted(len(p) for p in ps)
    assert outs == hf_greedy(hf_model(tiny_model_dir("qwen3")), ps, 12)


def test_chunks_and_cached_prefixes_start_mid_sequence():
    """Chunked prefill (16 tokens a step) and prefix-cache hits: the lone steps start past
    token 0, and their tokens' cache slots come from the block table."""
    ps = prompts(3, seed=1)
    shared = ps[0] + ps[1]
    batch = [shared + [7, 8, 9], shared + [1, 2], ps[2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = {"max_num_batched_tokens": 16, "enable_prefix_caching": True}
    eng = engine(True, **kw)
    lone = count_lone_prefills(eng)
    outs = [eng.generate([p], params)[0]["token_ids"] for p in batch]
    assert lone and max(lone) <= 16
    ref = engine(False, **kw)
    assert outs == [ref.generate([p], params)[0]["token_ids"] for p in batch]
    assert eng.block_manager.prefix_cache_hits > 0


def test_padding_rows_write_no_cache_slot():
    eng = engine(True, num_gpu_blocks_override=64, max_model_len=128)
    caches = [layer.kv_cache for layer in eng.runner.attention_layers]
    for c in caches:  # allocated uninitialised: a NaN there would never compare equal
        c.fill_(0.5)
    before = [c.clone() for c in caches]
    rid = eng.add_request([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=1, temperature=0.0))[0]
    seq = eng._requests[rid].seq
    eng.step()  # 5 tokens padded to 16: 11 rows of padding
    slots = eng.runner.prefill.dev[SLOTS]
    assert torch.equal(slots[5:16], torch.full((11,), -1))
    first, second = seq.block_table[0] * 4, seq.block_table[1] * 4
    assert slots[:5].tolist() == [first, first + 1, first + 2, first + 3, second]
    blocks = set(seq.block_table)
    for c, b in zip(caches, before):
        changed = {int(i) for i in (c != b).flatten(2).any(-1).any(0).nonzero()}
        assert changed and changed <= blocks


def test_steps_with_others_or_prompt_logprobs_stay_eager():
    eng = engine(True)
    lone = count_lone_prefills(eng)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.generate(prompts(3, seed=2), params)  # three prompts in one step
    eng.generate(prompts(1, seed=3), SamplingParams(max_tokens=2, prompt_logprobs=1))
    eng.generate([[1] * 70], params)  # longer than the largest size
    assert lone == []
