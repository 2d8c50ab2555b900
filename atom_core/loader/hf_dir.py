"""A Hugging Face model directory: config.json, safetensors weights, tokenizer, generation
config."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from atom_core.errors import ConfigError
from atom_core.loader.fp8_checkpoint import Fp8Layout, dequantized, fp8_layout

logger = logging.getLogger(__name__)

# The generation_config.json fields the engine uses as request defaults.
GENERATION_KEYS = (
    "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "max_new_tokens", "bos_token_id", "eos_token_id", "pad_token_id",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_config(path: Path) -> PretrainedConfig:
    """The model config of a directory, or of a config.json file named directly.

    A ``model_type`` transformers reads only through the checkpoint's own code (Kimi-K2's
    "kimi_k2", whose ``auto_map`` names DeepSeek-V3's config) is read with transformers'
    config class for the checkpoint's architecture instead: no checkpoint code runs, and
    transformers never stops to ask whether it may."""
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        config = _config_for_architecture(path)
        if config is None:
            raise ConfigError(f"cannot read a model config from {path}: {exc}") from exc
        return config


def _config_for_architecture(path: Path) -> PretrainedConfig | None:
    """config.json read with the config class of the model type whose causal LM is the
    file's ``architectures[0]`` (DeepseekV3ForCausalLM -> deepseek_v3); None without one."""
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
        arch = (data.get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError):
        return None
    model_type = next((t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == arch),
                      None)
    if model_type is None:
        return None
    logger.info("%s: model_type %r read as %r, the config of %s", path, data.get("model_type"),
                model_type, arch)
    config = CONFIG_MAPPING[model_type].from_dict(
        {k: v for k, v in data.items() if k not in ("model_type", "auto_map")})
    config.name_or_path = str(path)
    return config


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


def iter_weights(path: Path, device: torch.device | str | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor, read lazily one at a time (memory-mapped); an
    FP8 checkpoint's quantized weights dequantized, on ``device`` where given
    (loader/fp8_checkpoint.py). An MXFP4 checkpoint's tensors come as shipped
    (``*_blocks``, ``*_scales``): a model that serves MXFP4 (gpt-oss) keeps them packed,
    any other refuses their names."""
    layout = _fp8_layout(path)
    tensors = _iter_files(path)
    yield from dequantized(tensors, layout, device) if layout is not None else tensors


def is_fp8_checkpoint(hf_config: PretrainedConfig) -> bool:
    """Whether the weights of the checkpoint ``hf_config`` was read from are FP8
    (loader/fp8_checkpoint.py)."""
    return _layout(getattr(hf_config, "quantization_config", None)) is not None


def _fp8_layout(path: Path) -> Fp8Layout | None:
    return _layout(_quantization_config(path))


def _layout(quant: dict[str, Any] | None) -> Fp8Layout | None:
    """The FP8 layout a ``quantization_config`` describes: None for unquantized and MXFP4
    weights; an unsupported one is a ConfigError naming it."""
    if (quant or {}).get("quant_method") == "mxfp4":
        return None
    return fp8_layout(SimpleNamespace(quantization_config=quant))


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
    """The directory's tokenizer; one that only the checkpoint's own code builds (Kimi-K2's
    TikTokenTokenizer) is refused at once, never run and never asked about on a terminal."""
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc
