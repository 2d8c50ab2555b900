"""The KV cache's page size: ``--block-size`` where given; otherwise the largest the model's
attention backends prefer on the device (the Triton backend's TMA pages on Hopper), else
``DEFAULT_BLOCK_SIZE``. The engine's drafter, runner and block manager all read the one
resolved value, and a model's greedy output does not depend on it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from atom_core.config import DEFAULT_BLOCK_SIZE, Config
from atom_core.engine.llm_engine import LLMEngine
from atom_core.engine.model_runner import resolve_block_size
from atom_core.layers.attention.native import NativeAttentionBackend
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

CPU = torch.device("cpu")


def model_preferring(*sizes: int | None) -> SimpleNamespace:
    layers = [SimpleNamespace(backend=SimpleNamespace(preferred_block_size=lambda d, s=s: s))
              for s in sizes]
    return SimpleNamespace(attention_layers=lambda: layers)


def test_given_block_size_stands_over_any_preference():
    config = Config()
    config.cache_config.block_size = 8
    assert resolve_block_size(config, model_preferring(64), CPU) == 8
    assert config.cache_config.block_size == 8


def test_the_largest_preference_else_the_default():
    for sizes, want in [((None, 32, 64, None), 64), ((None, None), DEFAULT_BLOCK_SIZE),
                        ((), DEFAULT_BLOCK_SIZE), ((32,), 32)]:
        config = Config()
        assert config.cache_config.block_size is None
        assert resolve_block_size(config, model_preferring(*sizes), CPU) == want
        assert config.cache_config.block_size == want  # written back for the engine's parts


def test_engine_takes_the_backends_preference(monkeypatch):
    # Prompts sharing a 140-token prefix, in chunks of 48 tokens a step, with prefix caching:
    # cached blocks, chunks and decodes cross the pages' edges differently at each size.
    shared = [(7 * i) % 200 + 1 for i in range(140)]
    prompts = [shared + [5, 6, 7], [11, 12, 13], shared + [9] * 30]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for preferred in (None, 32, 64):
        monkeypatch.setattr(NativeAttentionBackend, "preferred_block_size",
                            lambda self, device, p=preferred: p, raising=False)
        eng = LLMEngine(str(tiny_model_dir("qwen3")), enable_log_stats=False, device="cpu",
                        enable_prefix_caching=True, max_num_batched_tokens=48)
        assert eng.block_manager.block_size == (preferred or DEFAULT_BLOCK_SIZE)
        assert eng.runner.block_size == eng.block_manager.block_size
        assert eng.runner.kv_layers[0].kv_cache.shape[2] == eng.block_manager.block_size
        first = [o["token_ids"] for o in eng.generate(prompts, params)]
        again = [o["token_ids"] for o in eng.generate(prompts, params)]  # from the cache
        assert eng.block_manager.prefix_cache_hits > 0
        assert again == first
        outputs[preferred] = first
    assert outputs[None] == outputs[32] == outputs[64]
