"""A Hugging Face model directory: config.json, safetensors weights, tokenizer, generation
config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from atom_core.errors import ConfigError
from atom_core.loader.fp8_blocks import dequantized, fp8_block_size

# The generation_config.json fields the engine uses as request defaults.
GENERATION_KEYS = (
    "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "max_new_tokens", "bos_token_id", "eos_token_id", "pad_token_id",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_config(path: Path) -> PretrainedConfig:
    """The model config of a directory, or of a config.json file named directly."""
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read a model config from {path}: {exc}") from exc


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shards: those the index names, else model.safetensors, else all."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ConfigError(
            f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    return found


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor, read lazily one at a time (memory-mapped); a
    block-FP8 checkpoint's quantized weights dequantized (loader/fp8_blocks.py). An MXFP4
    checkpoint's tensors come as shipped (``*_blocks``, ``*_scales``): a model that
    serves MXFP4 (gpt-oss) keeps them packed, any other refuses their names."""
    quant = _quantization_config(path)
    if (quant or {}).get("quant_method") == "mxfp4":
        yield from _iter_files(path)
        return
    block = fp8_block_size(SimpleNamespace(quantization_config=quant))
    tensors = _iter_files(path)
    yield from dequantized(tensors, block) if block is not None else tensors


def _iter_files(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _quantization_config(path: Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config``, if the directory has one."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config}: {exc}") from exc


def generation_defaults(path: Path | None, hf_config: PretrainedConfig) -> dict[str, Any]:
    """Sampling defaults from generation_config.json, else from the model config alone."""
    if path is not None and (path / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(str(path))
    else:
        gen = GenerationConfig.from_model_config(hf_config)
    diff = gen.to_diff_dict()
    return {k: diff[k] for k in GENERATION_KEYS if diff.get(k) is not None}


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: Path) -> Any:
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc
