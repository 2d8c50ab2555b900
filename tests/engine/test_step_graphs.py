"""Step graphs' padded inputs: a step with prompt tokens (a lone prompt, chunks, prompts
beside decodes) runs over static buffers padded to a captured size. On CPU the same padded
inputs run eagerly (no graphs), so the padding, the -1 capacity entries, the table rows,
the placeholder fill and the sampled rows are checked here against the plain engine and
transformers; the graphs themselves replay on a GPU (the Triton plugin's GPU tests and
bench/serving_gpu.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from atom_core.engine import step_graphs
from atom_core.engine.llm_engine import LLMEngine
from atom_core.engine.step_graphs import MAX_PROMPTS, SLOTS
from atom_core.sampling_params import SamplingParams
from atom_core.testing.engine_reference import hf_greedy, hf_model, staggered_generate
from atom_core.testing.tiny_models import tiny_model_dir

SIZES = [16, 32, 64]


def engine(padded: bool, **kw) -> LLMEngine:
    eng = LLMEngine(str(tiny_model_dir("qwen3")), enable_log_stats=False, device="cpu",
                    block_size=4, prefill_cudagraph_sizes=SIZES, **kw)
    eng.runner.fast_decode = True
    eng.runner._setup_fast_decode()
    if padded:
        eng.runner._setup_step_graphs(use_graphs=False)
    return eng


def count_graphed(eng: LLMEngine) -> list[list[int]]:
    """The token counts of each step that took the step-graph path."""
    seen: list[list[int]] = []
    launch = eng.runner._launch_graphed

    def spy(batch, ids_from):
        seen.append(list(batch.num_scheduled_tokens))
        return launch(batch, ids_from)

    eng.runner._launch_graphed = spy
    return seen


def prompts(n: int, seed: int = 0, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, longest))] for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_lone_prompts_padded_equal_transformers(async_scheduling):
    ps = prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng = engine(True, async_scheduling=async_scheduling)
    graphed = count_graphed(eng)
    outs = [eng.generate([p], params)[0]["token_ids"] for p in ps]  # one at a time: alone
    assert sorted(g[0] for g in graphed) == sorted(len(p) for p in ps)
    assert outs == hf_greedy(hf_model(tiny_model_dir("qwen3")), ps, 12)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompts_beside_decodes_equal_eager_and_transformers(async_scheduling):
    """Prompts and chunks (a 24-token budget) share steps with running decodes; with
    --async-scheduling the decodes' input ids come from the step queued before."""
    ps = prompts(7, seed=4, longest=40)
    lengths = [9, 14, 5, 11, 16, 7, 12]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    kw = dict(max_num_batched_tokens=24, async_scheduling=async_scheduling)
    eng = engine(True, **kw)
    graphed = count_graphed(eng)
    outs = staggered_generate(eng, ps, params, every=2)
    assert outs == staggered_generate(engine(False, **kw), ps, params, every=2)
    hf = hf_greedy(hf_model(tiny_model_dir("qwen3")), ps, max(lengths))
    assert outs == [h[:n] for h, n in zip(hf, lengths)]
    mixed = [g for g in graphed if 1 in g and max(g) > 1]
    assert len(mixed) >= 4  # prompts really ran beside decodes from the padded buffers
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_chunks_and_cached_prefixes_start_mid_sequence():
    """Chunked prefill (16 tokens a step) and prefix-cache hits: the steps start past
    token 0, and their tokens' cache slots come from the block table."""
    ps = prompts(3, seed=1)
    shared = ps[0] + ps[1]
    batch = [shared + [7, 8, 9], shared + [1, 2], ps[2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = {"max_num_batched_tokens": 16, "enable_prefix_caching": True}
    eng = engine(True, **kw)
    graphed = count_graphed(eng)
    outs = [eng.generate([p], params)[0]["token_ids"] for p in batch]
    assert graphed and max(sum(g) for g in graphed) <= 16
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
    slots = eng.runner.steps.dev_tok[SLOTS]
    assert torch.equal(slots[5:16], torch.full((11,), -1))
    first, second = seq.block_table[0] * 4, seq.block_table[1] * 4
    assert slots[:5].tolist() == [first, first + 1, first + 2, first + 3, second]
    blocks = set(seq.block_table)
    for c, b in zip(caches, before):
        changed = {int(i) for i in (c != b).flatten(2).any(-1).any(0).nonzero()}
        assert changed and changed <= blocks


def test_sequence_fields_mark_decodes_prompts_and_padding():
    steps = engine(True).runner.steps
    qsl = np.array([0, 1, 6, 7, 10])
    counts = np.diff(qsl)
    steps._write_seq_fields(qsl, np.array([9, 5, 30, 3]), counts, [0, 2, 3])
    f, cap = steps._seq, steps.max_seqs
    assert f[steps._qsl : steps._qsl + cap + 1].tolist() == [0, 1, 6, 7, 10] + [10] * (cap - 4)
    assert f[steps._lens : steps._lens + cap].tolist() == [9, 5, 30, 3] + [0] * (cap - 4)
    assert f[steps._dec : steps._dec + cap].tolist() == [0, 2] + [-1] * (cap - 2)
    assert f[steps._pre : steps._pre + MAX_PROMPTS].tolist() == [1, 3] + [-1] * (MAX_PROMPTS - 2)
    assert f[steps._sample : steps._sample + 3].tolist() == [0, 6, 9]


def test_steps_outside_the_graphs_stay_eager(monkeypatch):
    eng = engine(True, max_num_batched_tokens=512)
    graphed = count_graphed(eng)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.generate(prompts(MAX_PROMPTS + 1, seed=2, longest=6), params)  # too many prompts
    eng.generate(prompts(1, seed=3), SamplingParams(max_tokens=2, prompt_logprobs=1))
    eng.generate([[1] * 70], params)  # longer than the largest size
    assert graphed == []
    # A decode past LONG_DECODE_CONTEXT beside a prompt: the step runs eagerly.
    monkeypatch.setattr(step_graphs, "LONG_DECODE_CONTEXT", 8)
    staggered_generate(eng, [[3] * 10, [4] * 5], [params, params], every=1)
    assert not any(1 in g for g in graphed)
