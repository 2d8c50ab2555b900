"""Tiny random gpt-oss checkpoints saved with transformers, built once per process, and
transformers' models of them (the reference).

- "bf16": ``save_pretrained`` of a random model (the unquantized layout; fp32 values);
- "mxfp4": the same weights with the experts quantized to MXFP4 and written as the
  published checkpoints ship them (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``);
  transformers reads it dequantized (``Mxfp4Config(dequantize=True)``);
- "dequantized": what transformers' ``save_pretrained`` writes of that dequantized model.

Alternating sliding-window (8 tokens) and full layers, YaRN as gpt-oss configures it,
sinks and router biases large enough to matter, and a SwiGLU limit the activations reach.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from atom_core.quant.mxfp4 import quantize
from atom_core.testing.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, build_tokenizer

SLIDING_WINDOW = 8
EXPERT_STACKS = ("gate_up_proj", "down_proj")


def tiny_config() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, max_position_embeddings=512,
        rms_norm_eps=1e-5, swiglu_limit=1.0, initializer_range=0.1, bos_token_id=256,
        eos_token_id=EOS_TOKEN_ID, pad_token_id=256, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16,
        },
    )


_root: Path | None = None
_dirs: dict[str, Path] = {}


def tiny_dir(variant: str = "bf16") -> Path:
    """The checkpoint directory of ``variant`` (module docstring)."""
    global _root
    if variant in _dirs:
        return _dirs[variant]
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="atom-tiny-gptoss-"))
        atexit.register(shutil.rmtree, _root, True)
    path = _root / variant
    if variant == "bf16":
        _save_random(path)
    elif variant == "mxfp4":
        _save_mxfp4(tiny_dir("bf16"), path)
    elif variant == "dequantized":
        hf_model("mxfp4").save_pretrained(path)
        build_tokenizer().save_pretrained(path)
    else:
        raise ValueError(f"unknown tiny gpt-oss variant {variant!r}")
    _dirs[variant] = path
    return path


def hf_model(variant: str = "bf16") -> Any:
    """transformers' fp32 model of ``tiny_dir(variant)``, eager attention."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if variant == "mxfp4" else {}
    return AutoModelForCausalLM.from_pretrained(
        tiny_dir(variant), dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()


def _save_random(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # a wrong norm wiring shows in the logits
            elif name.endswith("sinks") or name.endswith("router.bias"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)


def _save_mxfp4(src: Path, path: Path) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, path)
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.rpartition(".")[2] not in EXPERT_STACKS:
            tensors[name] = tensor
            continue
        # Stored [E, K, N]; quantized along K, as [E, N, K/32, 16] bytes and [E, N, K/32].
        blocks, scales = quantize(tensor.transpose(1, 2))
        tensors[f"{name}_blocks"] = blocks.view(*scales.shape, 16)
        tensors[f"{name}_scales"] = scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
