"""FP8 checkpoints (loader/fp8_checkpoint.py): tiny random DeepSeek-V3 (MLA, routed and
shared experts) and Qwen3 checkpoints saved in each published FP8 layout (DeepSeek-V3 /
Qwen3-FP8's ``weight_scale_inv`` per block; the per-tensor ``fp8`` layout with static
input scales; compressed-tensors' float-quantized weights per channel, per tensor without
activation quantization, and per block) load, and their logits equal those of the same
model saved unquantized with the dequantized weights; served in FP8 (the default where the
device computes in FP8), their tokens are those weights' under ``--quantization fp8``. The
dequantization against loops written here; pairing in either order; anything else in
``quantization_config`` refused by name."""

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
from atom_core.loader.fp8_checkpoint import Fp8Layout, dequantize, dequantized, fp8_layout
from atom_core.testing.tiny_models import tiny_model_dir

BLOCK = (16, 16)  # tiny shapes: 40 x 64 and 96 x 48 weights end in partial tiles
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and per-block scale, each block scaled to its absolute maximum."""
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


def ct_group(strategy: str, acts: str | None, block: list[int] | None = None) -> dict:
    """A compressed-tensors config group as llm-compressor writes it."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": strategy, "block_structure": block, "group_size": None}
    inputs = None
    if acts == "dynamic":
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                  "strategy": "token"}
    elif acts == "static":
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                  "strategy": "tensor"}
    return {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
            "output_activations": None}


def ct_config(*groups: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}}


# layout -> (quantization_config, scale tensor's name, the scales' tile: None per tensor,
# (1, K) per output channel, else a block; static input scales written or not)
LAYOUTS = {
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(BLOCK)}, "weight_scale_inv", BLOCK, False),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_scale",
                   None, True),
    "ct-channel": (ct_config(ct_group("channel", "dynamic")), "weight_scale", "channel", False),
    "ct-tensor-w8a16": (ct_config(ct_group("tensor", None)), "weight_scale", None, False),
    "ct-tensor-static": (ct_config(ct_group("tensor", "static")), "weight_scale", None, True),
    "ct-block": (ct_config(ct_group("block", "dynamic", list(BLOCK))), "weight_scale", BLOCK,
                 False),
}


def quantize_as(weight: torch.Tensor, tile: tuple[int, int] | str | None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale tensor as the layout ships it, the dequantized weight)."""
    n, k = weight.shape
    if tile is None:
        q, scales = quantize(weight, (n, k))
        return q, scales.reshape(1), reference_dequantize(q, scales, (n, k))
    if tile == "channel":
        q, scales = quantize(weight, (1, k))
        return q, scales, reference_dequantize(q, scales, (1, k))  # scales [N, 1]
    q, scales = quantize(weight, tile)
    return q, scales, reference_dequantize(q, scales, tile)


def fp8_pair(kind: str, root: Path, layout: str = "fp8-block") -> tuple[Path, Path]:
    """(tiny ``kind`` saved in ``layout``, the same weights dequantized, saved unquantized).
    Linear projections are quantized; norms, embeddings, routers, the LM head stay, as
    the published checkpoints do."""
    quant, scale_name, tile, static = LAYOUTS[layout]
    src = tiny_model_dir(kind)
    fp8, plain = root / f"{kind}-{layout}", root / f"{kind}-plain"
    shutil.copytree(src, fp8)
    shutil.copytree(src, plain)
    quantized, dequant = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"):
                stem = name.removesuffix(".weight")
                q, scales, dequant[name] = quantize_as(tensor, tile)
                quantized[name], quantized[f"{stem}.{scale_name}"] = q, scales
                if static:
                    quantized[f"{stem}.input_scale"] = torch.tensor([0.02])
            else:
                quantized[name] = dequant[name] = tensor
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequant, str(plain / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = quant
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, plain


@pytest.mark.parametrize(("kind", "layout"), [
    ("deepseek_v3", "fp8-block"), ("qwen3", "fp8-block"), ("qwen3", "fp8-tensor"),
    ("qwen3", "ct-channel"), ("deepseek_v3", "ct-channel"), ("qwen3", "ct-tensor-w8a16"),
    ("qwen3", "ct-tensor-static"), ("qwen3", "ct-block"),
])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(kind, layout, tmp_path):
    from atom_core.config import Config
    from atom_core.layers.attention.metadata import AttentionMetadata
    from atom_core.layers.context import forward_context
    from atom_core.loader import load_model

    fp8, plain = fp8_pair(kind, tmp_path, layout)
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


@pytest.mark.parametrize("layout", ["ct-channel", "fp8-tensor"])
def test_an_fp8_checkpoint_serves_in_fp8_as_its_dequantized_weights_do(layout, tmp_path):
    """Through the engine with fp8 compute (weights re-quantized per output channel,
    activations per token, an fp8 cache): the checkpoint's greedy tokens and logprobs are
    those of its dequantized weights saved unquantized."""
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    fp8, plain = fp8_pair("qwen3", tmp_path, layout)
    prompt = [(7 * i + 3) % 250 for i in range(21)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = []
    for path in (fp8, plain):
        engine = LLMEngine(str(path), device="cpu", enable_log_stats=False,
                           quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_w8a8_min_rows=1)
        outs.append(engine.generate([prompt], params)[0])
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert [e.logprob for e in outs[0]["logprobs"]] == [e.logprob for e in outs[1]["logprobs"]]


def test_an_fp8_checkpoint_is_served_in_fp8_where_the_device_computes_in_fp8(tmp_path,
                                                                          monkeypatch):
    """As vLLM serves one: quantized again at load unless --quantization none; on a device
    without FP8 compute (the CPU here) dequantized. Unquantized checkpoints unchanged."""
    import atom_core.loader as loader
    from atom_core.config import Config

    fp8, plain = fp8_pair("qwen3", tmp_path, "ct-channel")

    def e4m3_params(path: Path, **kw) -> int:
        model = loader.load_model(Config.from_kwargs(model=str(path), **kw), "cpu",
                                  torch.float32).model
        return sum(p.dtype == torch.float8_e4m3fn for p in model.parameters())

    assert e4m3_params(fp8) == 0
    monkeypatch.setattr(loader, "computes_fp8", lambda device: True)
    assert e4m3_params(fp8) > 0
    assert e4m3_params(fp8, quantization="none") == 0
    assert e4m3_params(plain) == 0
    assert e4m3_params(plain, quantization="fp8") == e4m3_params(fp8)


def test_dequantize_equals_a_loop_over_blocks_channels_and_tensors():
    torch.manual_seed(0)
    for shape in [(40, 64), (96, 48), (16, 16), (7, 33)]:
        w = torch.randn(shape)
        q, scales = quantize(w, BLOCK)
        torch.testing.assert_close(dequantize(q, scales, BLOCK),
                                   reference_dequantize(q, scales, BLOCK), rtol=0, atol=0)
        for tile in (None, "channel"):
            q, scales, want = quantize_as(w, tile)
            torch.testing.assert_close(dequantize(q, scales, None), want, rtol=0, atol=0)
            torch.testing.assert_close(dequantize(q, scales.reshape(-1), None), want,
                                       rtol=0, atol=0)
            # A block group beside a channel or tensor group: the scale's shape decides.
            torch.testing.assert_close(dequantize(q, scales, BLOCK), want, rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"needs \(3, 4\) scales"):
        dequantize(q.new_zeros(40, 64), torch.ones(2, 4), BLOCK)
    with pytest.raises(ConfigError, match=r"takes one scale or 40 \(per output channel\)"):
        dequantize(q.new_zeros(40, 64), torch.ones(64), None)


BLOCK_LAYOUT = Fp8Layout("fp8", "weight_scale_inv", BLOCK)


def test_pairs_in_either_order_and_lone_tensors_are_refused():
    q, scales = quantize(torch.randn(32, 32), BLOCK)
    norm = torch.ones(4)
    want = reference_dequantize(q, scales, BLOCK)
    for order in ([("a.weight", q), ("a.weight_scale_inv", scales), ("n.weight", norm)],
                  [("a.weight_scale_inv", scales), ("n.weight", norm), ("a.weight", q)]):
        got = dict(dequantized(order, BLOCK_LAYOUT))
        assert set(got) == {"a.weight", "n.weight"}
        torch.testing.assert_close(got["a.weight"], want, rtol=0, atol=0)
        assert got["n.weight"] is norm
    with pytest.raises(ConfigError, match="without their pair.*b.weight_scale_inv"):
        list(dequantized([("a.weight", q), ("a.weight_scale_inv", scales),
                          ("b.weight_scale_inv", scales)], BLOCK_LAYOUT))
    with pytest.raises(ConfigError, match="without their pair.*c.weight"):
        list(dequantized([("c.weight", q)], BLOCK_LAYOUT))


def test_pairs_are_dequantized_on_the_device_given():
    """The e4m3 pair goes to the device before it is multiplied out (one byte a value over
    the bus, not four); the other tensors stay where they were read."""
    q, scales = quantize(torch.randn(32, 32), BLOCK)
    norm = torch.ones(4)
    got = dict(dequantized([("a.weight", q), ("a.weight_scale_inv", scales),
                            ("n.weight", norm)], BLOCK_LAYOUT, torch.device("meta")))
    assert got["a.weight"].is_meta and got["a.weight"].shape == q.shape
    assert got["a.weight"].dtype == torch.float32
    assert got["n.weight"] is norm


def test_static_input_scales_are_dropped_and_kv_scales_pass():
    q, scale, want = quantize_as(torch.randn(8, 32), None)
    k_scale = torch.tensor(0.5)
    got = dict(dequantized([("l.q_proj.input_scale", torch.tensor([0.1])),
                            ("l.q_proj.weight", q), ("l.q_proj.weight_scale", scale),
                            ("l.k_scale", k_scale)],
                           Fp8Layout("compressed-tensors", "weight_scale", None)))
    assert set(got) == {"l.q_proj.weight", "l.k_scale"}
    torch.testing.assert_close(got["l.q_proj.weight"], want, rtol=0, atol=0)
    assert got["l.k_scale"] is k_scale


def layout_of(quant: dict) -> Fp8Layout | None:
    return fp8_layout(SimpleNamespace(quantization_config=quant))


def test_each_published_layout_is_read():
    assert fp8_layout(SimpleNamespace()) is None
    assert layout_of({"quant_method": "fp8", "weight_block_size": [128, 128]}) == Fp8Layout(
        "fp8", "weight_scale_inv", (128, 128))
    assert layout_of({"quant_method": "fp8", "activation_scheme": "static"}) == Fp8Layout(
        "fp8", "weight_scale", None)
    for group in (ct_group("channel", "dynamic"), ct_group("tensor", "static"),
                  ct_group("tensor", None)):
        assert layout_of(ct_config(group)) == Fp8Layout("compressed-tensors", "weight_scale",
                                                        None)
    assert layout_of(ct_config(ct_group("block", "dynamic", [128, 128]),
                               ct_group("channel", "dynamic"))) == Fp8Layout(
        "compressed-tensors", "weight_scale", (128, 128))


def ct_with(weights: dict | None = None, acts: dict | None = None, **config) -> dict:
    group = ct_group("channel", "dynamic")
    group["weights"].update(weights or {})
    if acts is not None:
        group["input_activations"].update(acts)
    return {**ct_config(group), **config}


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size.*not a block"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'e5m2'"),
    (ct_with(format="pack-quantized"), "format 'pack-quantized' is not supported"),
    (ct_with(format="int-quantized"), "format 'int-quantized' is not supported"),
    (ct_with({"type": "int"}), "weights of type 'int' with 8 bits"),
    (ct_with({"num_bits": 4}), "weights of type 'float' with 4 bits"),
    (ct_with({"symmetric": False}), "symmetric and static"),
    (ct_with({"dynamic": True}), "symmetric and static"),
    (ct_with({"strategy": "group"}), "strategy 'group' is not supported"),
    (ct_with({"strategy": "block", "block_structure": None}), "block_structure None"),
    (ct_with(acts={"type": "int"}), "activations of type 'int'"),
    (ct_with(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    (ct_with(config_groups={}), "no config_groups"),
    (ct_config(ct_group("block", "dynamic", [128, 128]), ct_group("block", "dynamic", [64, 64])),
     "different block structures"),
])
def test_other_quantization_configs_are_refused_by_name(quant, message):
    with pytest.raises(ConfigError, match=message):
        layout_of(quant)


def test_an_unsupported_checkpoint_fails_at_load(tmp_path):
    from atom_core.engine.llm_engine import LLMEngine

    path = tmp_path / "awq"
    shutil.copytree(tiny_model_dir("qwen3"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'awq' is not supported"):
        LLMEngine(str(path), device="cpu", enable_log_stats=False)
