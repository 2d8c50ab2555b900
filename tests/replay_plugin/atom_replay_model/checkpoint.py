"""Write a ReplayForCausalLM model directory: config.json, model.safetensors, the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write_script(path: str | Path, token_ids: list[int]) -> None:
    """The script the model replays next (read when a sequence starts). Written to a
    temporary name and renamed, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"token_ids": list(token_ids)}))
    tmp.replace(path)


def write_replay_model(
    path: str | Path,
    tokenizer: Any,
    *,
    script: str | Path | None = None,
    token_ids: list[int] | None = None,
    max_position_embeddings: int = 4096,
) -> Path:
    """A model directory whose model replays the ``script`` file (see ``write_script``),
    or ``token_ids`` when no file is named. ``tokenizer`` (a transformers tokenizer, with
    the chat template the test wants) is saved beside it; EOS is the tokenizer's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.eos_token_id
    config: dict[str, Any] = {
        # model_type llama: transformers reads the config; architectures picks the model.
        "architectures": ["ReplayForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "max_position_embeddings": max_position_embeddings,
        "eos_token_id": eos,
        "bos_token_id": tokenizer.bos_token_id,
        "torch_dtype": "float32",
    }
    if script is not None:
        config["replay_script"] = str(script)
    if token_ids is not None:
        config["replay_token_ids"] = list(token_ids)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    save_file({"gain": torch.ones(1)}, str(path / "model.safetensors"))
    tokenizer.save_pretrained(path)
    return path
