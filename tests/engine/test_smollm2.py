"""The embedded default (SmolLM2-135M-Instruct, GGUF) through the whole engine vs transformers."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from atom_core.loader import embedded_model_path
from atom_core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me two tips for learning Python.",
]


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine  # tests/conftest.py's, shared with test_generation_defaults_offline.py


def test_default_is_the_embedded_gguf(engine):
    assert engine.loaded.source == f"gguf:{embedded_model_path()}"
    assert engine.hf_config.architectures == ["LlamaForCausalLM"]


def test_16_greedy_tokens_identical_to_transformers(engine, hf_smollm2):
    hf = hf_smollm2
    prompts = [engine.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([engine.tokenize(prompt)])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out["token_ids"] == ref[0, ids.shape[1]:].tolist()
    assert "Paris" in outs[0]["text"]


def test_atom_generate_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "atom_core.entrypoints.cli", "generate",
         "What is the capital of France?", "--max-tokens", "12", "--max-model-len", "512"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_simple_inference_example():
    proc = subprocess.run(
        [sys.executable, "-m", "atom_core.examples.simple_inference", "--max-tokens", "8",
         "--max-model-len", "512", "--no-enable-log-stats"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Completion:") == 4
    assert re.search(r"^4 requests, \d+ tokens in", proc.stdout, re.M)
