"""The engine on CPU with every op and the attention backend from Triton (interpreted),
through the GPU decode path (persistent inputs, cached sampling batch, one copy of the
sampled ids): greedy tokens equal transformers'. Graph capture itself needs CUDA
(tests/gpu/test_cuda_graph_decode.py)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")


import atom_kernels_triton.attention_backend as triton_backend  # noqa: E402
import atom_kernels_triton.gemv as gemv  # noqa: E402
from atom_kernels_triton import hooks  # noqa: E402
from atom_kernels_triton.decode_attention import PRELOAD_MIN_SPLITS  # noqa: E402
from atom_kernels_triton.gemv_config import GemvConfig  # noqa: E402

import atom_core.fusion.decoder as decoder  # noqa: E402
import atom_core.layers.rotary as rotary  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.ops.deferred_norm import DeferredNorm  # noqa: E402
from atom_core.plugins import reset_plugins  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from atom_core.testing.engine_reference import hf_greedy, hf_model  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402

NEW_TOKENS = 5


@pytest.fixture
def triton_everywhere(monkeypatch):
    """Register the Triton ops and backend for the CPU too (the interpreter runs them)."""
    monkeypatch.setattr(hooks, "unavailable_reason", lambda: None)
    monkeypatch.setattr(hooks, "DEVICE_KINDS", ("cpu", "cuda", "hip"))
    monkeypatch.setattr(rotary, "_shared", {})  # rope modules resolved their op when built
    # GEMV grids sized for 8 SMs, as the attention backend's are on CPU: the interpreter's
    # time grows with the programs, and an H200-sized grid of 4-column tiles took ~2/3 of
    # this test's minutes. The tiles the H200 uses are test_gemv_triton.py's.
    monkeypatch.setattr(gemv, "_num_sms", lambda device: 8)
    reset_plugins()
    yield
    reset_plugins()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_triton_fast_decode_matches_transformers(kind, triton_everywhere, monkeypatch):
    path = tiny_model_dir(kind)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 19, 40)]
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu", block_size=8)
    assert engine.runner.attention_backend_name == "triton"
    layer = engine.runner.model.model.layers[0]
    assert "triton" in layer.input_layernorm._rms_norm.__module__
    assert "triton" in layer.mlp._silu_and_mul_linear.__module__  # the fused down projection
    # Both norms fold into the next projection (a decode batch of 3 rows is the GEMV's).
    assert "triton" in layer.input_layernorm._rms_norm_linear.__module__
    assert layer.attn_parts.input_proj is layer.self_attn.qkv_proj
    engine.runner.fast_decode = True
    engine.runner._setup_fast_decode()
    calls = []
    fast = engine.runner._launch_decode
    engine.runner._launch_decode = (
        lambda seqs, ids_from: calls.append(len(seqs)) or fast(seqs, ids_from)
    )
    launches = []  # per decode-attention launch: (Qwen3's attention input fused in?, splits)
    attend = triton_backend.paged_decode_attention
    monkeypatch.setattr(triton_backend, "paged_decode_attention",
                        lambda *a, **kw: launches.append((kw.get("new_tokens") is not None, a[7]))
                        or attend(*a, **kw))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == hf_greedy(hf_model(path), prompts, NEW_TOKENS)
    assert len(calls) >= NEW_TOKENS - 2 and max(calls) == len(prompts)
    # Qwen3's q/k norms, RoPE and cache write run inside decode attention wherever it does
    # not preload (the backend's rule); Llama's input is RoPE alone and never fuses.
    qwen3 = kind == "qwen3"
    assert launches and all(f == (qwen3 and s < PRELOAD_MIN_SPLITS) for f, s in launches)
    assert any(f for f, _ in launches) == qwen3


# Llama's dense path is Qwen3's without the q/k norms: test_triton_fast_decode_... covers it.
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_deferred_norms_decode_matches_transformers(kind, triton_everywhere, monkeypatch):
    """Every decode-sized GEMV split along K, so each o_proj and down projection (and the
    MoE's pairs' sum) finishes the next norm (atom_core.ops.deferred_norm) and the qkv,
    gate_up, router and expert kernels read it: still transformers' greedy tokens."""
    split = GemvConfig(BLOCK_N=64, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=2)
    table = gemv.get_config
    monkeypatch.setattr(gemv, "get_config", lambda m, *a: split if m > 1 else table(m, *a))
    inputs = []
    pre_norm = decoder._pre_norm
    monkeypatch.setattr(decoder, "_pre_norm", lambda norm, sub, parts, x, *a:
                        inputs.append(isinstance(x, DeferredNorm))
                        or pre_norm(norm, sub, parts, x, *a))
    path = tiny_model_dir(kind)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (7, 23, 31)]
    engine = LLMEngine(str(path), enable_log_stats=False, device="cpu", block_size=8)
    engine.runner.fast_decode = True
    engine.runner._setup_fast_decode()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == hf_greedy(hf_model(path), prompts, 4)
    # Decode steps of 2-3 rows: every norm but the first layer's input norm came deferred.
    layers = len(engine.runner.model.model.layers)
    assert sum(inputs) >= 2 * (2 * layers - 1)


def _fp8_greedy(kind: str, prompts: list[list[int]], new_tokens: int) -> tuple[list, LLMEngine]:
    engine = LLMEngine(str(tiny_model_dir(kind)), enable_log_stats=False, device="cpu",
                       block_size=8, dtype="float16", quantization="fp8", kv_cache_dtype="fp8",
                       fp8_w8a8_min_rows=1 << 20)
    engine.runner.fast_decode = True
    engine.runner._setup_fast_decode()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=3)
    return engine.generate(prompts, params), engine


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_fp8_weights_and_cache_decode_match_the_native_ops(kind, monkeypatch):
    """fp8 weights (weight-only: fp16 rows on CPU) and an fp8 cache through the Triton
    GEMV, fused MoE and attention kernels, with the fused decode forms: each step's top
    log-probabilities equal those of the same engine on the torch reference ops, and so do
    the greedy tokens up to a near tie (the tiny random model's logits are nearly flat:
    two candidates 0.01 apart may swap under fp16 rounding), after which the texts part."""
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (6, 17)]
    reset_plugins()
    want, _ = _fp8_greedy(kind, prompts, 5)
    monkeypatch.setattr(hooks, "unavailable_reason", lambda: None)
    monkeypatch.setattr(hooks, "DEVICE_KINDS", ("cpu", "cuda", "hip"))
    monkeypatch.setattr(rotary, "_shared", {})
    monkeypatch.setattr(gemv, "_num_sms", lambda device: 8)
    reset_plugins()
    try:
        got, engine = _fp8_greedy(kind, prompts, 5)
    finally:
        reset_plugins()
    layer = engine.runner.model.model.layers[0]
    assert engine.runner.attention_backend_name == "triton"
    assert "triton" in layer.input_layernorm._rms_norm_linear.__module__
    assert layer.self_attn.qkv_proj.fp8 is not None
    compared = 0
    for g, w in zip(got, want):
        assert len(g["logprobs"]) == len(w["logprobs"]) == 5
        for eg, ew in zip(g["logprobs"], w["logprobs"]):
            top_g, top_w = dict(eg.top), dict(ew.top)
            for token in top_g.keys() & top_w.keys():
                assert top_g[token] == pytest.approx(top_w[token], abs=2e-2)
                compared += 1
            if eg.token_id != ew.token_id:  # a near tie: each engine's pick is the other's
                assert top_w.get(eg.token_id, -1e9) > ew.logprob - 2e-2
                assert top_g.get(ew.token_id, -1e9) > eg.logprob - 2e-2
                break
    assert compared >= 10
