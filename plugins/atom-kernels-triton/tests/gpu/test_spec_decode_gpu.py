"""Speculative decoding on the GPU (Triton attention, CUDA graphs): verify steps run as
decode rows from the decode graphs, one row per draft, so rows of one sequence read K/V
that the same step wrote (the decode kernel's preloading grids reload those rows after
their wait). Greedy output with n-gram drafts and with a draft model equals the engine
without them, in fp32 so verify rows and plain decodes round alike; a model drafting for
itself has every draft accepted. Batch 1 runs the many-split (preloading) grid."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 4, [20, 21, 22, 23, 24, 25] * 5, [7] * 12,
           [11, 12, 13, 14, 15] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3]
LENGTHS = (40, 23, 31, 17, 29)
KW = dict(device="cuda", dtype="float32", enable_log_stats=False, max_model_len=512,
          enable_prefix_caching=True)


def outputs(kind: str, batch: int, **kw) -> tuple[LLMEngine, list[list[int]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in LENGTHS[:batch]]
    engine = LLMEngine(str(tiny_model_dir(kind)), **KW, **kw)
    return engine, [o["token_ids"] for o in engine.generate(PROMPTS[:batch], params)]


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("k", [1, 3])
def test_ngram_greedy_equals_plain_on_gpu(kind, batch, k):
    _, plain = outputs(kind, batch)
    spec, outs = outputs(kind, batch, method="ngram", num_speculative_tokens=k)
    assert outs == plain
    assert spec.speculator.stats.total_accepted_tokens > 0
    assert spec.runner.graphs is not None


@pytest.mark.parametrize("batch", [1, 5])
def test_target_as_its_own_draft_on_gpu(batch):
    _, plain = outputs("qwen3", batch)
    spec, outs = outputs("qwen3", batch, method="draft_model", num_speculative_tokens=3,
                         draft_model=str(tiny_model_dir("qwen3")))
    assert outs == plain
    stats = spec.speculator.stats
    assert stats.total_draft_tokens > 20
    assert stats.total_accepted_tokens == stats.total_draft_tokens
