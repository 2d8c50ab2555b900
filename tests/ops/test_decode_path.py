"""The engine on CPU with every op and the attention backend from Triton (interpreted),
through the GPU decode path (persistent inputs, cached sampling batch, one copy of the
sampled ids): greedy tokens equal transformers'. Graph capture itself needs CUDA
(tests/gpu/test_cuda_graph_decode.py)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from transformers import AutoModelForCausalLM  # noqa: E402

import atom_core.layers.rotary as rotary  # noqa: E402
import atom_core.ops.triton.plugin as triton_plugin  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.plugins import reset_plugins  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from tests.tiny_models import tiny_model_dir  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture
def triton_everywhere(monkeypatch):
    """Register the Triton ops and backend for the CPU too (the interpreter runs them)."""
    monkeypatch.setattr(triton_plugin, "usable", lambda: True)
    monkeypatch.setattr(triton_plugin, "TRITON_DEVICE_KINDS", ("cpu", "cuda", "hip"))
    monkeypatch.setattr(rotary, "_shared", {})  # rope modules resolved their op when built
    reset_plugins()
    yield
    reset_plugins()


def hf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_triton_fast_decode_matches_transformers(kind, triton_everywhere):
    path = tiny_model_dir(kind)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 19, 40)]
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu", block_size=8)
    assert engine.runner.attention_backend_name == "triton"
    layer = engine.runner.model.model.layers[0]
    assert "triton" in layer.input_layernorm._rms_norm.__module__
    engine.runner.fast_decode = True
    engine.runner._setup_fast_decode()
    calls = []
    fast = engine.runner._execute_decode
    engine.runner._execute_decode = lambda seqs: calls.append(len(seqs)) or fast(seqs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == hf_greedy(path, prompts)
    assert len(calls) >= NEW_TOKENS - 2 and max(calls) == len(prompts)
