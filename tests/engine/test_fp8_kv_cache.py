"""``--kv_cache_dtype fp8`` through the engine: the embedded SmolLM2 (real weights) and a
tiny DeepSeek-V3 (MLA's latent cache) score a fixed public-domain text, prefilled in
32-token chunks so that every chunk after the first attends over the e4m3 cache, within 3%
of the perplexity with the cache in the model's dtype; a backend without an fp8 cache is
refused at start."""

from __future__ import annotations

import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.errors import ConfigError
from atom_core.layers.attention.native import NativeAttentionBackend
from atom_core.testing.tiny_models import tiny_model_dir
from tests.perplexity import CHUNKED, TEXT, perplexity


@pytest.mark.slow
def test_smollm2_perplexity_with_an_fp8_cache_within_3_percent():
    base = perplexity(LLMEngine(**CHUNKED), TEXT)
    fp8 = perplexity(LLMEngine(kv_cache_dtype="fp8", **CHUNKED), TEXT)
    assert fp8 == pytest.approx(base, rel=0.03), (base, fp8)
    assert 1.5 < base < 100  # a real model reading real text


def test_mla_latent_cache_in_fp8_within_3_percent():
    path = str(tiny_model_dir("deepseek_v3"))
    prompt = [(7 * i + 3) % 250 for i in range(120)]
    base = perplexity(LLMEngine(path, **CHUNKED), prompt)
    fp8 = perplexity(LLMEngine(path, kv_cache_dtype="fp8", **CHUNKED), prompt)
    assert fp8 == pytest.approx(base, rel=0.03), (base, fp8)
    assert fp8 != base  # the later chunks did read rounded latents


def test_a_backend_without_an_fp8_cache_is_refused(monkeypatch):
    monkeypatch.setattr(NativeAttentionBackend, "fp8_kv_cache", False)
    with pytest.raises(ConfigError, match="native attention backend has no fp8 KV cache"):
        LLMEngine(str(tiny_model_dir("llama")), kv_cache_dtype="fp8", device="cpu",
                  enable_log_stats=False)
