"""Per-layer fp8 KV-cache scales (layers/attention/kv_scales.py): every checkpoint naming
convention reaches its layer (MHA and MLA), bad scale tensors are refused by name, the
``--kv-cache-scales`` fallback and the start-up line. End to end: tiny Llama, Qwen3 and
DeepSeek-V3 checkpoints saved with k_scale/v_scale tensors load without a complaint, their
scales reach the layers, and the logits over an fp8 cache equal those of the same model
over an fp32 cache that holds the dequantized values (``e4m3(x / scale) * scale``)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_core.config import Config
from atom_core.errors import ConfigError
from atom_core.layers.attention import mla_native, native
from atom_core.layers.attention.kv_scales import KVScaleLoader, resolve_kv_scales
from atom_core.layers.context import forward_context
from atom_core.loader import build_model, load_model
from atom_core.loader.hf_dir import load_config
from atom_core.ops.native import kv_cache as native_kv_cache
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches
from atom_core.testing.tiny_models import tiny_model_dir

FP8 = torch.float8_e4m3fn

# Per kind: checkpoint tensor name -> value, one naming convention per layer (or two).
SCALES = {
    "llama": {  # ModelOpt's projection names, then compressed-tensors' block names
        "model.layers.0.self_attn.k_proj.k_scale": 0.37,
        "model.layers.0.self_attn.v_proj.v_scale": 2.9,
        "model.layers.1.self_attn.k_scale": 0.61,
        "model.layers.1.self_attn.v_scale": 1.3,
    },
    "qwen3": {  # vLLM's attention-module names, the older single kv_scale, qkv_proj's
        "model.layers.0.self_attn.attn.k_scale": 0.37,
        "model.layers.0.self_attn.attn.v_scale": 2.9,
        "model.layers.1.self_attn.kv_scale": 0.77,
        "model.layers.2.self_attn.qkv_proj.k_scale": 0.45,
        "model.layers.2.self_attn.qkv_proj.v_scale": 1.7,
    },
    "deepseek_v3": {  # one latent scale per layer: K's; a V scale does not apply
        "model.layers.0.self_attn.k_proj.k_scale": 0.037,
        "model.layers.0.self_attn.v_proj.v_scale": 5.0,
        "model.layers.1.self_attn.kv_scale": 0.061,
        "model.layers.2.self_attn.mla_attn.k_scale": 0.029,
    },
}
# What each kind's layers apply: (k, v) for MHA, (latent,) for MLA.
EXPECTED = {
    "llama": [(0.37, 2.9), (0.61, 1.3)],
    "qwen3": [(0.37, 2.9), (0.77, 0.77), (0.45, 1.7)],
    "deepseek_v3": [(0.037,), (0.061,), (0.029,)],
}
TOKENS = torch.tensor([5, 17, 42, 8, 99, 3, 250, 61, 7, 19, 200, 31, 64])
STEPS = ((0, 8), (8, 12), (12, 13))  # a prompt, a chunk over the cached prefix, a decode


def flat(scales: list[tuple[float, ...]]) -> list[float]:
    return [s for layer in scales for s in layer]


def tiny_model(kind: str):
    return build_model(load_config(tiny_model_dir(kind)), "cpu", torch.float32)


def test_every_naming_convention_reaches_its_layer():
    for kind in ("llama", "qwen3", "deepseek_v3"):
        model = tiny_model(kind)
        loader = KVScaleLoader(model)
        for name, value in SCALES[kind].items():
            assert loader.load(name, torch.tensor([value]))
        got = [layer.kv_scales for layer in model.attention_layers()]
        assert [len(g) for g in got] == [len(e) for e in EXPECTED[kind]]
        assert flat(got) == pytest.approx(flat(EXPECTED[kind])), kind
        assert all(layer.kv_scales_from_checkpoint for layer in model.attention_layers())
        assert not loader.load("model.norm.weight", torch.ones(4))  # not a scale: passed on


@pytest.mark.parametrize(("name", "tensor", "error", "message"), [
    ("model.layers.0.self_attn.k_scale", torch.ones(2), ConfigError, r"shape \[2\]"),
    ("model.layers.0.self_attn.k_scale", torch.tensor(0.0), ConfigError, "positive, got 0.0"),
    ("model.layers.0.self_attn.v_scale", torch.tensor(-1.0), ConfigError, "got -1.0"),
    ("model.layers.0.self_attn.kv_scale", torch.tensor(float("nan")), ConfigError, "nan"),
    ("model.layers.1.self_attn.v_scale", torch.tensor(float("inf")), ConfigError, "inf"),
    ("model.layers.0.mlp.k_scale", torch.tensor(1.0), KeyError, "no attention layer"),
    ("model.layers.7.self_attn.k_scale", torch.tensor(1.0), KeyError, "no attention layer"),
])
def test_bad_scale_tensors_are_refused_by_name(name, tensor, error, message):
    with pytest.raises(error, match=message):
        KVScaleLoader(tiny_model("llama")).load(name, tensor)


def test_the_flag_fills_layers_the_checkpoint_left_out():
    model = tiny_model("llama")
    layers = model.attention_layers()
    KVScaleLoader(model).load("model.layers.0.self_attn.kv_scale", torch.tensor(0.5))
    line = resolve_kv_scales(layers, "fp8", [2.0, 3.0])
    assert [layer.kv_scales for layer in layers] == [(0.5, 0.5), (2.0, 3.0)]
    assert line == ("fp8 KV cache scales: 1 layers from the checkpoint (0.5 to 0.5), "
                    "1 layers --kv-cache-scales 2 3")
    model = tiny_model("deepseek_v3")
    line = resolve_kv_scales(model.attention_layers(), "fp8", [0.25])
    assert [layer.kv_scales for layer in model.attention_layers()] == [(0.25,)] * 3
    assert line == "fp8 KV cache scales: 3 layers --kv-cache-scales 0.25"
    line = resolve_kv_scales(tiny_model("qwen3").attention_layers(), "fp8", None)
    assert line == "fp8 KV cache scales: 3 layers 1.0 (none in the checkpoint)"


def test_scales_are_unused_without_an_fp8_cache():
    model = tiny_model("llama")
    assert resolve_kv_scales(model.attention_layers(), "bf16", None) is None
    KVScaleLoader(model).load("model.layers.1.self_attn.k_scale", torch.tensor(0.5))
    line = resolve_kv_scales(model.attention_layers(), "bf16", None)
    assert line == ("the checkpoint's KV-cache scales (1 layers) are not used: the KV cache "
                    "is bf16, not fp8")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_cache_scales": [2.0]}, "needs --kv_cache_dtype fp8"),
    ({"kv_cache_dtype": "fp8", "kv_cache_scales": [1.0, 2.0, 3.0]}, "one or two"),
    ({"kv_cache_dtype": "fp8", "kv_cache_scales": [0.0]}, "finite positive"),
    ({"kv_cache_dtype": "fp8", "kv_cache_scales": [float("nan")]}, "finite positive"),
])
def test_the_flag_is_checked(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_kwargs(**kwargs)


def with_scales(kind: str, root: Path) -> Path:
    """tiny ``kind`` saved again with SCALES[kind] among its tensors (shape [] or [1], fp32
    and bf16, as checkpoints ship them)."""
    path = root / f"{kind}-kv-scales"
    shutil.copytree(tiny_model_dir(kind), path)
    tensors = load_file(str(path / "model.safetensors"))
    for i, (name, value) in enumerate(SCALES[kind].items()):
        tensors[name] = torch.tensor([value] if i % 2 else value,
                                     dtype=torch.bfloat16 if i == 1 else torch.float32)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def run(model, cache_dtype: torch.dtype) -> torch.Tensor:
    """Logits of TOKENS computed in STEPS (the later ones read the cache)."""
    kv = PagedKV(num_blocks=8, block_size=4, seed=1)
    allocate_kv_caches(model, kv, cache_dtype)
    sid = kv.add_sequence()
    logits = []
    for start, end in STEPS:
        meta, positions = kv.step([sid], [end - start])
        with torch.inference_mode(), forward_context(meta):
            logits.append(model.compute_logits(model(TOKENS[start:end], positions)))
    return torch.cat(logits)


def dequantizing_store(monkeypatch) -> None:
    """Make the native cache writes store ``e4m3(x / scale) * scale`` in a float cache, read
    back as an fp8 cache is (a whole prompt too): the reference model then attends over the
    dequantized values an fp8 cache would hold."""
    original = native_kv_cache.store_rows

    def store(flat, slot_mapping, values, scale=1.0):
        held = (values.float() * (1.0 / scale)).clamp(-448, 448).to(FP8)
        original(flat, slot_mapping, held.float() * scale)

    monkeypatch.setattr(native_kv_cache, "store_rows", store)
    monkeypatch.setattr(mla_native, "store_rows", store)
    monkeypatch.setattr(native, "FP8_KV_DTYPE", torch.float32)
    monkeypatch.setattr(mla_native, "FP8_KV_DTYPE", torch.float32)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v3"])
def test_a_checkpoint_with_scales_loads_and_attends_over_its_dequantized_cache(
        kind, tmp_path, caplog, monkeypatch):
    path = with_scales(kind, tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config  # an fp8-KV-only checkpoint
    with caplog.at_level(logging.INFO):
        model = load_model(Config.from_kwargs(model=str(path), device="cpu",
                                              kv_cache_dtype="fp8"), "cpu", torch.float32).model
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"fp8 KV cache scales: {len(EXPECTED[kind])} layers from the checkpoint" in caplog.text
    layers = model.attention_layers()
    got = flat([layer.kv_scales for layer in layers])
    assert got == pytest.approx(flat(EXPECTED[kind]), rel=1e-2)  # one was saved in bf16

    fp8 = run(model, FP8)
    assert torch.isfinite(fp8).all()
    with monkeypatch.context() as patch:
        dequantizing_store(patch)
        reference = run(model, torch.float32)
    torch.testing.assert_close(fp8, reference)
    # The scales matter: over an fp8 cache with scales of one the logits move, the prompt
    # step's too (it reads its K/V back from the cache as the later steps do).
    for layer in layers:
        layer.set_kv_scales(1.0, 1.0)
    unscaled = run(model, FP8)
    assert (unscaled[:8] - fp8[:8]).abs().max() > 1e-4
    assert (unscaled[8:] - fp8[8:]).abs().max() > 1e-4


def test_a_cache_in_the_model_dtype_ignores_the_checkpoint_scales(tmp_path, caplog):
    path = with_scales("llama", tmp_path)
    with caplog.at_level(logging.INFO):
        scaled = load_model(Config.from_kwargs(model=str(path), device="cpu"), "cpu",
                            torch.float32).model
    assert "KV-cache scales (2 layers) are not used: the KV cache is bf16" in caplog.text
    plain = load_model(Config.from_kwargs(model=str(tiny_model_dir("llama")), device="cpu"),
                       "cpu", torch.float32).model
    torch.testing.assert_close(run(scaled, torch.float32), run(plain, torch.float32),
                               rtol=0, atol=0)
