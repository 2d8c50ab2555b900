"""A checkpoint served in FP8 is quantized as it is read: the linears and experts are built
without storage, allocated in e4m3, and each weight loader quantizes the rows it copies.
The result is the bits that loading in the model dtype and quantizing afterwards gives,
while the weights held during loading take the FP8 model's bytes, not the model dtype's."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import safetensors.torch as st
import torch

import atom_core.loader as loader
from atom_core.config import Config
from atom_core.errors import ConfigError
from atom_core.layers.linear import default_weight_loader
from atom_core.loader import hf_dir, load_model
from atom_core.quant.fp8 import FP8_DTYPE
from atom_core.quant.online import computes_fp8, quantize_model, require_fp8_device
from atom_core.testing.tensor_parallel import step_logits, tensor_parallel_logits
from atom_core.testing.tiny_models import tiny_model_dir

DENSE = ["llama-tied", "qwen3"]
KINDS = [*DENSE, "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "minimax_m2"]
STEPS = [[[1, 5, 9, 2], [7, 3]], [[4], [8]]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _quantized_after_loading(path: str, dtype: torch.dtype = torch.float32,
                             **quant) -> torch.nn.Module:
    """The model loaded in its dtype, then quantized: the path a dummy or GGUF model takes."""
    config = Config.from_kwargs(model=path, quantization="none")
    model = load_model(config, "cpu", dtype, fuse=False).model
    kinds = quant.get("fp8_layers", config.model_config.fp8_layers)
    quantize_model(model, kinds, quant.get("fp8_w8a8_min_rows"))
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_as_read_gives_the_bits_of_quantizing_after(kind):
    path = str(tiny_model_dir(kind))
    got = load_model(Config.from_kwargs(model=path, quantization="fp8"), "cpu", torch.float32,
                     fuse=False).model
    want = _quantized_after_loading(path)
    got_params, want_params = dict(got.named_parameters()), dict(want.named_parameters())
    assert got_params.keys() == want_params.keys()
    e4m3 = [name for name, p in want_params.items() if p.dtype == FP8_DTYPE]
    assert any(".experts." in n for n in e4m3) == (kind not in DENSE)
    assert "lm_head.weight" not in e4m3 and len(e4m3) > 4  # the head is not a default kind
    for name, want_param in want_params.items():
        got_param = got_params[name]
        assert got_param.dtype == want_param.dtype, name
        assert torch.equal(_bits(got_param.data), _bits(want_param.data)), name
    for a, b in zip(step_logits(got, STEPS), step_logits(want, STEPS), strict=True):
        assert torch.equal(a, b)


def test_layer_kinds_and_the_crossover_apply_as_read():
    """In bf16, from an fp32 checkpoint: each row is rounded to bf16 before it is quantized,
    as the bf16 weight quantized after loading was."""
    path = str(tiny_model_dir("qwen3_moe"))
    quant = dict(fp8_layers=["experts", "attention", "lm_head"], fp8_w8a8_min_rows=3)
    got = load_model(Config.from_kwargs(model=path, quantization="fp8", **quant), "cpu",
                     torch.bfloat16, fuse=False).model
    want = _quantized_after_loading(path, torch.bfloat16, **quant)
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(_bits(a.data), _bits(b.data)), name
    dtypes = {name: p.dtype for name, p in got.named_parameters()}
    assert dtypes["model.layers.0.mlp.experts.w13_weight"] == FP8_DTYPE
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == FP8_DTYPE
    assert dtypes["lm_head.weight"] == FP8_DTYPE  # quantized once read
    assert dtypes["model.layers.0.mlp.gate.weight"] == torch.float32  # the router, as built
    layer = got.model.layers[0]
    assert layer.self_attn.qkv_proj.fp8.w8a8_min_rows == 3
    assert layer.mlp.experts.fp8[0].w8a8_min_rows == 3


def _load_watching_bytes(monkeypatch, path: str, quantization: str) -> tuple[int, int]:
    """(the most bytes the model's weights held while the checkpoint was read, their bytes
    once loaded)."""
    seen: list[int] = []
    built: list[torch.nn.Module] = []
    build, read = loader.build_model, hf_dir.iter_weights

    def held() -> int:
        return sum(p.nbytes for p in built[-1].parameters() if not p.is_meta)

    def watching_build(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    def watching_read(*args) -> Iterator[tuple[str, torch.Tensor]]:
        for item in read(*args):
            seen.append(held())
            yield item
        seen.append(held())

    monkeypatch.setattr(loader, "build_model", watching_build)
    monkeypatch.setattr(hf_dir, "iter_weights", watching_read)
    load_model(Config.from_kwargs(model=path, quantization=quantization), "cpu",
               torch.bfloat16, fuse=False)
    return max(seen), held()


def _head_bytes(path: str) -> int:
    model = load_model(Config.from_kwargs(model=path), "cpu", torch.bfloat16, fuse=False).model
    return model.lm_head.weight.nbytes


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_the_weights_held_while_reading_are_the_fp8_models(kind, monkeypatch):
    path = str(tiny_model_dir(kind))
    peak, fp8 = _load_watching_bytes(monkeypatch, path, "fp8")
    plain_peak, plain = _load_watching_bytes(monkeypatch, path, "none")
    assert plain_peak == plain
    # The LM head is quantized after reading (tied heads share the embedding's rows), so
    # the reading holds it in bf16: its e4m3 copy is what the loaded model adds.
    head = _head_bytes(path)
    assert peak <= fp8 + head // 2
    assert peak < 0.7 * plain, (peak, plain)


def test_two_ranks_quantize_their_own_rows_as_read():
    """Row-parallel layers' ranks read a K slice of every row and quantize it with a scale
    of its own; the ranks' logits stay near one process's FP8 logits."""
    path = str(tiny_model_dir("qwen3"))
    one, plain = _fp8_and_plain_logits(path)
    ranks = tensor_parallel_logits([(path, dict(quantization="fp8"))], STEPS)[0]
    for logits, _ in ranks:
        for got, want, ref in zip(logits, one, plain, strict=True):
            assert torch.allclose(got, want, atol=0.1, rtol=0.05)
            assert not torch.equal(got, ref)


def test_expert_parallel_ranks_quantize_whole_experts_as_one_process_does():
    """Under expert parallelism a rank holds whole experts and skips the others' tensors:
    its experts' rows get one process's scales, so the logits match it up to the order
    of the ranks' sums (the attention and dense layers are split as under TP)."""
    path = str(tiny_model_dir("qwen3_moe"))
    one, _ = _fp8_and_plain_logits(path)
    ranks = tensor_parallel_logits([(path, dict(quantization="fp8"))], STEPS,
                                   expert_parallel=True)[0]
    for logits, _ in ranks:
        for got, want in zip(logits, one, strict=True):
            assert torch.allclose(got, want, atol=0.1, rtol=0.05)


def _fp8_and_plain_logits(path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    def logits(**quant) -> list[torch.Tensor]:
        config = Config.from_kwargs(model=path, **quant)
        return step_logits(load_model(config, "cpu", torch.float32).model, STEPS)

    return logits(quantization="fp8"), logits()


def test_an_e4m3_weight_is_never_filled_by_a_cast():
    with pytest.raises(TypeError, match="store_rows"):
        default_weight_loader(torch.empty(2, 3, dtype=FP8_DTYPE), torch.ones(2, 3))


def test_a_checkpoint_that_does_not_fit_still_fails_loudly(tmp_path):
    src = tiny_model_dir("qwen3")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (weights,) = hf_dir.safetensors_files(tmp_path)
    tensors = st.load_file(weights)
    name = next(n for n in tensors if n.endswith("o_proj.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()
    st.save_file(tensors, weights)
    with pytest.raises(ValueError, match="does not fit"):
        load_model(Config.from_kwargs(model=str(tmp_path), quantization="fp8"), "cpu",
                   torch.float32)


@pytest.mark.parametrize(("capability", "fp8"), [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_a_gpu_without_fp8_is_refused_before_anything_is_built(capability, fp8, monkeypatch):
    """Ampere is refused by name; Ada and Hopper compute in FP8 (what serves an FP8
    checkpoint in FP8 by default). Checked before the model is built, so the CPU test
    never touches CUDA."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    cuda = torch.device("cuda")
    assert computes_fp8(cuda) is fp8
    assert not computes_fp8(torch.device("cpu"))
    if fp8:
        require_fp8_device(cuda, "--quantization fp8")
        return
    built = []
    monkeypatch.setattr(loader, "build_model", lambda *a, **k: built.append(a))
    config = Config.from_kwargs(model=str(tiny_model_dir("qwen3")), quantization="fp8")
    with pytest.raises(ConfigError, match=r"--quantization fp8 needs FP8 support .* "
                                          r"NVIDIA A100 has 8\.0"):
        load_model(config, "cuda", torch.bfloat16)
    assert not built
