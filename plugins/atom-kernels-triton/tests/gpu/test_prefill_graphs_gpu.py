"""Prefill CUDA graphs on the GPU: a lone prompt's step replayed from a captured graph
(padded to the next size) gives the tokens the eager step gives, greedy and bf16, whether
the prompt is whole, chunked or behind a cached prefix."""

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
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402


def run(graphs: bool, prompts: list[list[int]], **kw) -> tuple[list[list[int]], list[int]]:
    eng = LLMEngine(str(tiny_model_dir("qwen3")), device="cuda", dtype="bfloat16",
                    enable_log_stats=False, max_model_len=512,
                    prefill_cudagraph_sizes=[16, 32, 64, 128] if graphs else [], **kw)
    assert (eng.runner.prefill is not None) == graphs
    lone: list[int] = []
    if graphs:  # sizes past the step's token budget are never needed, so not captured
        budget = kw.get("max_num_batched_tokens", 512)
        assert sorted(eng.runner.prefill.graphs) == [s for s in (16, 32, 64, 128) if s <= budget]
        launch = eng.runner._launch_prefill

        def spy(batch):
            lone.append(batch.num_scheduled_tokens[0])
            return launch(batch)

        eng.runner._launch_prefill = spy
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [eng.generate([p], params)[0]["token_ids"] for p in prompts], lone


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 32, "enable_prefix_caching": True}])
def test_graph_prefill_equals_eager(kw):
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (2, 17, 64, 100)]
    prompts += [shared + [1, 2, 3], shared + [4, 5]]
    eager, _ = run(False, prompts, **kw)
    graphed, lone = run(True, prompts, **kw)
    assert graphed == eager
    assert lone  # the graphs served the lone prompts
