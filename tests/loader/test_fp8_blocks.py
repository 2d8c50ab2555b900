"""Block-FP8 checkpoints (loader/fp8_blocks.py): tiny random DeepSeek-V3 (MLA, routed and
shared experts) and Qwen3 checkpoints saved in the DeepSeek-V3 / Qwen3-FP8 layout (e4m3
``weight`` + ``weight_scale_inv`` per block, ``quantization_config`` in config.json) load,
and their logits equal those of the same model saved unquantized with the dequantized
weights. The dequantization against a loop over blocks written here; pairing in either
order; anything else in ``quantization_config`` refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atom_core.errors import ConfigError
from atom_core.loader.fp8_blocks import dequantize_block, dequantized, fp8_block_size
from atom_core.testing.tiny_models import tiny_model_dir

BLOCK = (16, 16)  # tiny shapes: 40 x 64 and 96 x 48 weights end in partial tiles
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and per-block scale_inv, each block scaled to its absolute maximum."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    scales = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scales[i, j] = tile.abs().max().clamp_min(1e-12) / FP8_MAX
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (
                tile / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def reference_dequantize(q: torch.Tensor, scales: torch.Tensor,
                         block: tuple[int, int]) -> torch.Tensor:
    out = q.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= (
                scales[i, j])
    return out


def fp8_pair(kind: str, root: Path) -> tuple[Path, Path]:
    """(the block-FP8 checkpoint of tiny ``kind``, the same weights dequantized, saved
    unquantized). Linear projections are quantized; norms, embeddings, routers, the LM
    head stay, as the published checkpoints do."""
    src = tiny_model_dir(kind)
    fp8, plain = root / f"{kind}-fp8", root / f"{kind}-plain"
    shutil.copytree(src, fp8)
    shutil.copytree(src, plain)
    quantized, dequant = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"):
                q, scales = quantize(tensor, BLOCK)
                quantized[name], quantized[name + "_scale_inv"] = q, scales
                dequant[name] = reference_dequantize(q, scales, BLOCK)
            else:
                quantized[name] = dequant[name] = tensor
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequant, str(plain / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, plain


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3"])
def test_block_fp8_checkpoint_loads_as_its_dequantized_weights(kind, tmp_path):
    from atom_core.config import Config
    from atom_core.layers.attention.metadata import AttentionMetadata
    from atom_core.layers.context import forward_context
    from atom_core.loader import load_model

    fp8, plain = fp8_pair(kind, tmp_path)
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        assert any(f.get_slice(n).get_dtype() == "F8_E4M3" for n in f.keys())
    tokens = torch.tensor([5, 17, 42, 8, 99, 3, 250, 61])
    n = len(tokens)
    logits = []
    for path in (fp8, plain):
        loaded = load_model(Config.from_kwargs(model=str(path), device="cpu"), "cpu",
                            torch.float32)
        model = loaded.model
        for layer in model.attention_layers():
            layer.kv_cache = torch.zeros(layer.kv_cache_shape(1, 16), dtype=torch.float32)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=torch.zeros(1, 1, dtype=torch.int32), block_size=16, max_query_len=n,
            max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
        with torch.inference_mode(), forward_context(meta):
            logits.append(model.compute_logits(model(tokens, torch.arange(n))))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    assert logits[0].abs().max() > 0


def test_dequantize_block_equals_a_loop_over_blocks():
    torch.manual_seed(0)
    for shape in [(40, 64), (96, 48), (16, 16), (7, 33)]:
        q, scales = quantize(torch.randn(shape), BLOCK)
        torch.testing.assert_close(dequantize_block(q, scales, BLOCK),
                                   reference_dequantize(q, scales, BLOCK), rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"needs \(3, 4\) scales"):
        dequantize_block(q.new_zeros(40, 64), torch.ones(2, 4), BLOCK)


def test_pairs_in_either_order_and_lone_tensors_are_refused():
    q, scales = quantize(torch.randn(32, 32), BLOCK)
    norm = torch.ones(4)
    want = reference_dequantize(q, scales, BLOCK)
    for order in ([("a.weight", q), ("a.weight_scale_inv", scales), ("n.weight", norm)],
                  [("a.weight_scale_inv", scales), ("n.weight", norm), ("a.weight", q)]):
        got = dict(dequantized(order, BLOCK))
        assert set(got) == {"a.weight", "n.weight"}
        torch.testing.assert_close(got["a.weight"], want, rtol=0, atol=0)
        assert got["n.weight"] is norm
    with pytest.raises(ConfigError, match="without their pair.*b.weight_scale_inv"):
        list(dequantized([("a.weight", q), ("a.weight_scale_inv", scales),
                          ("b.weight_scale_inv", scales)], BLOCK))
    with pytest.raises(ConfigError, match="without their pair.*c.weight"):
        list(dequantized([("c.weight", q)], BLOCK))


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "without weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'e5m2'"),
])
def test_other_quantization_configs_are_refused_by_name(quant, message):
    with pytest.raises(ConfigError, match=message):
        fp8_block_size(SimpleNamespace(quantization_config=quant))
    assert fp8_block_size(SimpleNamespace()) is None
    assert fp8_block_size(SimpleNamespace(quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128]})) == (128, 128)


def test_an_unsupported_checkpoint_fails_at_load(tmp_path):
    from atom_core.engine.llm_engine import LLMEngine

    path = tmp_path / "awq"
    shutil.copytree(tiny_model_dir("qwen3"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'awq' is not supported"):
        LLMEngine(str(path), device="cpu", enable_log_stats=False)
