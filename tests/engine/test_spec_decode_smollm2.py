"""Speculative decoding on real weights: the embedded SmolLM2-135M (GGUF) with n-gram lookup
and with draft models, a batch of eight prompts with repeats (so lookups hit), prefix
caching, chunked prefill and preemption on. Greedy output equals the engine without
speculation token for token; SmolLM2 drafting for itself has every draft accepted; a tiny
random draft sharing its vocabulary is almost never right and changes nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from atom_core.engine.llm_engine import LLMEngine
from atom_core.loader import embedded_model_path
from atom_core.loader.gguf_loader import GGUFFile
from atom_core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Roses are red, violets are blue. Roses are red, violets are",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy cat.",
    "a b c d e f g h i j k l m n o p a b c d e f g",
]
LENGTHS = (24, 16, 20, 28, 12, 24, 18, 22)
# 16 blocks of 16 tokens do not hold all eight at once: preemption happens.
OPTS = dict(enable_log_stats=False, device="cpu", block_size=16, enable_prefix_caching=True,
            max_num_batched_tokens=64, num_gpu_blocks_override=16, max_model_len=256,
            max_num_seqs=8)


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [o["token_ids"] for o in LLMEngine(**OPTS).generate(TEXTS, params())]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> Path:
    """A one-layer Llama with SmolLM2's vocabulary and random weights."""
    smol = GGUFFile(embedded_model_path()).load_config()  # the engine's, without its weights
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=smol.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=smol.max_position_embeddings)
    path = tmp_path_factory.mktemp("random-draft")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def generate(**kw) -> tuple[LLMEngine, list[list[int]]]:
    engine = LLMEngine(**OPTS, **kw)
    outs = [o["token_ids"] for o in engine.generate(TEXTS, params())]
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return engine, outs


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_equals_plain(k, plain):
    engine, outs = generate(method="ngram", num_speculative_tokens=k)
    assert outs == plain
    stats = engine.speculator.stats
    assert stats.total_accepted_tokens > 20
    assert stats.average_tokens_per_forward > 1.2


def test_smollm2_as_its_own_draft_accepts_everything(plain):
    engine, outs = generate(method="draft_model", draft_model=str(embedded_model_path()),
                            num_speculative_tokens=3)
    assert outs == plain
    stats = engine.speculator.stats
    assert stats.total_draft_tokens > 50
    assert stats.total_accepted_tokens == stats.total_draft_tokens


def test_random_draft_equals_plain_with_low_acceptance(plain, random_draft):
    engine, outs = generate(method="draft_model", draft_model=str(random_draft),
                            num_speculative_tokens=3)
    assert outs == plain
    stats = engine.speculator.stats
    assert stats.total_draft_tokens > 50
    assert stats.acceptance_rate < 0.2
