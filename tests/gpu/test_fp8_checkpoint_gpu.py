"""On a GPU with FP8 compute, an FP8 checkpoint given no ``--quantization`` is served in FP8
(loader.load_model): its weights are e4m3 after loading and its greedy tokens are those of
its dequantized weights under ``--quantization fp8``; ``--quantization none`` keeps
``--dtype``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.quant.online import computes_fp8  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from tests.loader.test_fp8_checkpoint import fp8_pair  # noqa: E402

if not computes_fp8(torch.device("cuda")):
    pytest.skip("needs FP8 compute (compute capability 8.9 or later)", allow_module_level=True)


def served(path, **kw) -> tuple[bool, list[int]]:
    """(whether the model holds e4m3 weights, its greedy tokens for a fixed prompt)."""
    engine = LLMEngine(str(path), device="cuda", enable_log_stats=False,
                       num_gpu_blocks_override=64, **kw)
    fp8 = any(p.dtype == torch.float8_e4m3fn for p in engine.runner.model.parameters())
    prompt = [(11 * i + 5) % 250 for i in range(29)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = engine.generate([prompt], params)[0]["token_ids"]
    engine.shutdown()
    torch.cuda.empty_cache()
    return fp8, tokens


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
def test_an_fp8_checkpoint_is_served_in_fp8_with_no_flag(layout, tmp_path):
    fp8, plain = fp8_pair("qwen3", tmp_path, layout)
    auto, auto_tokens = served(fp8)
    assert auto
    flagged, flagged_tokens = served(plain, quantization="fp8")
    assert flagged and auto_tokens == flagged_tokens
    kept, _ = served(fp8, quantization="none")
    assert not kept
