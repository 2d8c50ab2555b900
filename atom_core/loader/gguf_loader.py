"""A llama-architecture .gguf file: config and tokenizer through transformers' GGUF support
(parsed once per file: ``gguf_cache``), weights dequantized with the ``gguf`` package and
renamed to Hugging Face names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PretrainedConfig

from atom_core.errors import ConfigError
from atom_core.loader.gguf_cache import Index, read_header, tensor_views

# GGUF model architecture -> the HF architecture transformers' config lacks for GGUF files.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1 frequency factors; the config's rope_scaling describes the same scaling.
_IGNORED = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _IGNORED:
        return None
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ConfigError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def reverse_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of q/k rows (its convert script interleaves each
    head's two rotary halves); the same as transformers' ``_reverse_permute_weights``."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


class GGUFFile:
    """One .gguf file: its header read once per file (``gguf_cache``: parsed on the first
    load, read back after), its tensors memory-mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header = read_header(path, self._check_architecture)

    def _check_architecture(self, index: Index) -> None:
        if index.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"{self.path}: GGUF architecture {index.architecture!r} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )

    def load_config(self) -> PretrainedConfig:
        config = self.header.config
        if not getattr(config, "architectures", None):
            config.architectures = [ARCHITECTURES[self.header.index.architecture]]
        return config

    def iter_weights(self, hf_config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor) for every tensor, dequantized one at a time."""
        from gguf import GGMLQuantizationType, dequantize

        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        for tensor, data in tensor_views(self.path, self.header.index):
            name = hf_name(tensor.name)
            if name is None:
                continue
            qtype = GGMLQuantizationType(tensor.tensor_type)
            weight = torch.from_numpy(dequantize(data, qtype).copy()).float()
            if ".q_proj." in name:
                weight = reverse_permute(weight, num_heads)
            elif ".k_proj." in name:
                weight = reverse_permute(weight, num_kv_heads)
            yield name, weight

    def load_tokenizer(self) -> Any:
        return self.header.tokenizer

    def chat_template(self) -> str | None:
        return self.header.index.chat_template


def load_gguf_tokenizer(path: Path) -> Any:
    """The tokenizer alone of a .gguf named by --tokenizer, whatever its model architecture
    (not cached: the header cache holds a config too, which needs a supported one)."""
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
