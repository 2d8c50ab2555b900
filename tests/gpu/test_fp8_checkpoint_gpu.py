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


def test_a_checkpoint_served_in_fp8_never_holds_its_linears_in_bf16(tmp_path):
    """The GPU memory a bf16 checkpoint's load takes under ``--quantization fp8`` (its rows
    quantized as they are read) against the same load in bf16: the linears' half is never
    allocated. ~470 MB of bf16 weights, almost all of them in the linears."""
    from transformers import AutoModelForCausalLM

    from atom_core.config import Config
    from atom_core.loader import load_model
    from atom_core.testing.tiny_models import tiny_config

    config = tiny_config("qwen3")
    config.update(dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                       layer_types=["full_attention"] * 16))
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)

    def peak(quantization: str) -> tuple[int, int]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loaded = load_model(Config.from_kwargs(model=str(tmp_path), quantization=quantization),
                            "cuda", torch.bfloat16)
        held = sum(p.nbytes for p in loaded.model.parameters())
        top = torch.cuda.max_memory_allocated() - start
        del loaded
        return top, held

    bf16_peak, bf16 = peak("none")
    fp8_peak, fp8 = peak("fp8")
    print(f"\nload peak: bf16 {bf16_peak / 2**20:.1f} MiB (weights {bf16 / 2**20:.1f}), "
          f"fp8 {fp8_peak / 2**20:.1f} MiB (weights {fp8 / 2**20:.1f})")
    assert fp8 < 0.55 * bf16
    # On top of the FP8 weights, one checkpoint tensor's quantization at a time: its bf16
    # copy and fp32 temporaries, under 16 bytes an element of the largest (gate or up).
    assert fp8_peak - fp8 < 16 * 4096 * 1024, (fp8_peak, fp8)
    assert fp8_peak < 0.65 * bf16_peak
