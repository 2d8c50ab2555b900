import shutil

import torch

from atom_core.config import Config
from atom_core.loader import load_model
from atom_core.loader.dummy import init_dummy_weights
from atom_core.testing.tiny_models import tiny_model_dir


def _dummy(model, mode, seed=0):
    config = Config.from_kwargs(model=str(model), load_dummy=mode, seed=seed)
    return load_model(config, "cpu", torch.float32)


def test_zero_mode_zeroes_every_linear(tmp_path):
    shutil.copy(tiny_model_dir("qwen3") / "config.json", tmp_path)  # a config and nothing else
    loaded = _dummy(tmp_path / "config.json", "zero")
    assert loaded.source.startswith("dummy-zero:") and loaded.tokenizer is None
    assert loaded.generation_defaults["eos_token_id"] == 258
    for name, p in loaded.model.named_parameters():
        assert not p.any(), name


def test_xavier_is_seeded():
    path = tiny_model_dir("llama")
    a, b, c = (_dummy(path, "xavier", seed).model for seed in (3, 3, 4))
    assert a.model.norm.weight.eq(1).all()
    assert a.model.layers[0].self_attn.qkv_proj.weight.std() > 0
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])


def test_dummy_from_a_directory_keeps_its_tokenizer_and_empty_mode_runs():
    loaded = _dummy(tiny_model_dir("llama"), "empty")
    assert loaded.tokenizer is not None
    names = init_dummy_weights(loaded.model, "empty")
    assert names == {n for n, _ in loaded.model.named_parameters()}
