"""Step CUDA graphs on the GPU: steps with prompt tokens (a lone prompt, chunks, prompts
beside running decodes) replayed from captured graphs, padded to the next size, give the
tokens eager steps give, greedy and bf16: a lone prompt's those of the plain eager engine,
and mixed steps those of the same padded inputs run eagerly (the decode part of a graph is
sized for its capacity, so the plain engine's decode attention splits differently; the CPU
tests check the padded inputs against it and transformers)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from atom_core.testing.engine_reference import staggered_generate  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402

SIZES = [16, 32, 64, 128]


def make(graphs: bool, padded: bool = False, **kw) -> tuple[LLMEngine, list[list[int]]]:
    """``padded`` (without graphs): the step graphs' padded inputs, run eagerly."""
    eng = LLMEngine(str(tiny_model_dir("qwen3")), device="cuda", dtype="bfloat16",
                    enable_log_stats=False, max_model_len=512,
                    prefill_cudagraph_sizes=SIZES if graphs else [], **kw)
    assert (eng.runner.steps is not None) == graphs
    if padded:
        eng.runner.config.compilation_config.prefill_cudagraph_sizes = SIZES
        eng.runner._setup_step_graphs(use_graphs=False)
    seen: list[list[int]] = []
    if graphs:  # up to the first size holding a whole step; larger are never replayed
        budget = kw.get("max_num_batched_tokens", 16384)
        want = [s for i, s in enumerate(SIZES) if i == 0 or SIZES[i - 1] < budget]
        assert sorted(eng.runner.steps.graphs) == want
        launch = eng.runner._launch_graphed

        def spy(batch, ids_from):
            seen.append(list(batch.num_scheduled_tokens))
            return launch(batch, ids_from)

        eng.runner._launch_graphed = spy
    return eng, seen


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 32, "enable_prefix_caching": True}])
def test_graph_lone_prompts_equal_eager(kw):
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (2, 17, 64, 100)]
    prompts += [shared + [1, 2, 3], shared + [4, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = []
    for graphs in (False, True):
        eng, seen = make(graphs, **kw)
        outs.append([eng.generate([p], params)[0]["token_ids"] for p in prompts])
    assert outs[1] == outs[0]
    assert seen  # the graphs served the lone prompts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_prompts_beside_decodes_equal_eager(async_scheduling):
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 90))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 30), ignore_eos=True)
              for _ in prompts]
    kw = {"max_num_batched_tokens": 48, "async_scheduling": async_scheduling}
    outs = []
    for graphs in (False, True):
        eng, seen = make(graphs, padded=not graphs, **kw)
        outs.append(staggered_generate(eng, prompts, params, every=2))
    assert outs[1] == outs[0]
    assert sum(1 for g in seen if 1 in g and max(g) > 1) >= 5  # mixed steps replayed
