"""Speculative decoding on the GPU (Triton attention, CUDA graphs for the plain steps,
verification eager): greedy output with n-gram drafts equals the engine without them,
in fp32 so the verify rows (the prefill kernel) and plain decodes (the decode kernel)
round alike."""

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


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_greedy_equals_plain_on_gpu(k):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (40, 23, 31, 17, 29)]
    kw = dict(device="cuda", dtype="float32", enable_log_stats=False, max_model_len=512,
              enable_prefix_caching=True)
    plain = LLMEngine(str(tiny_model_dir("qwen3")), **kw).generate(PROMPTS, params)
    spec = LLMEngine(str(tiny_model_dir("qwen3")), method="ngram", num_speculative_tokens=k,
                     **kw)
    outs = spec.generate(PROMPTS, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in plain]
    assert spec.speculator.stats.total_accepted_tokens > 0
