"""Tiny random checkpoints saved with transformers, built once per process.

``tiny_model_dir(kind)`` returns a Hugging Face directory (config.json, model.safetensors,
generation_config.json and a byte-level tokenizer with a ChatML template), so the same
directory serves layer tests, loader tests and engine tests. It depends only on
transformers/tokenizers, not on atom_core, so it is a fair reference.

Kinds: "llama", "llama3" (llama3 rope scaling), "llama-tied" (tied embeddings), "qwen3",
"qwen3_moe" (a dense layer among sparse ones), "deepseek_v2" (MLA without q_lora, grouped
softmax routing, yarn rope with DeepSeek's mscale), "deepseek_v3" (MLA with q_lora, sigmoid
routing with a random correction bias, groups, yarn), "kimi_k2" (DeepSeek-V3 at Kimi-K2's
shape: 384 experts, 8 a token, one shared, 64 heads, no groups), "glm4_moe" (GLM-4.5: half
the head rotated, per-head q/k norms, qkv bias, a dense first layer, shared expert, grouped
sigmoid routing), "glm4_moe_air" (GLM-4.5-Air: no q/k norms, no groups), "minimax_m2"
(q/k norms over the whole projection, partial RoPE, sigmoid routing, no shared experts).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 272  # 256 byte tokens + specials, a multiple of 16
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
EOS_TOKEN_ID = 258
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=256,
    tie_word_embeddings=False,
)


def tiny_config(kind: str) -> Any:
    """The transformers config of a tiny model kind."""
    from transformers import LlamaConfig, Qwen3Config

    if kind == "llama":
        return LlamaConfig(**_COMMON, rope_theta=10000.0)
    if kind == "llama-tied":
        return LlamaConfig(**{**_COMMON, "tie_word_embeddings": True}, rope_theta=10000.0)
    if kind == "llama3":
        rope = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**_COMMON, rope_scaling=rope)
    if kind == "qwen3":
        return Qwen3Config(**{**_COMMON, "num_hidden_layers": 3}, head_dim=32, rope_theta=1e6)
    if kind in _MOE_KINDS:
        return _moe_config(kind)
    raise ValueError(f"unknown tiny model kind {kind!r}")


_MOE_KINDS = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_air",
              "minimax_m2")


def _partial_rope_moe_config(kind: str) -> Any:
    from transformers import Glm4MoeConfig, MiniMaxM2Config

    if kind == "minimax_m2":  # the experts' width is intermediate_size
        return MiniMaxM2Config(
            **{**_COMMON, "intermediate_size": 32}, head_dim=32, rotary_dim=16, rope_theta=5e6,
            num_local_experts=8, num_experts_per_tok=2,
        )
    air = kind == "glm4_moe_air"
    return Glm4MoeConfig(
        **{**_COMMON, "num_hidden_layers": 3}, head_dim=32, partial_rotary_factor=0.5,
        rope_theta=1e6, attention_bias=True, use_qk_norm=not air, moe_intermediate_size=32,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=1 if air else 4,
        topk_group=1 if air else 2, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=1.0 if air else 2.5,
    )


def _moe_config(kind: str) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig

    if kind.startswith("glm4_moe") or kind == "minimax_m2":
        return _partial_rope_moe_config(kind)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **{**_COMMON, "num_hidden_layers": 3}, head_dim=32, rope_theta=1e6, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[1],
        )
    mla = dict(
        num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, first_k_dense_replace=1,
    )
    yarn = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
    }
    if kind == "deepseek_v2":  # V2-Lite-like: no q_lora; groups as in DeepSeek-V2 proper
        return DeepseekV2Config(
            **{**_COMMON, **mla}, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters={**yarn, "mscale": 1.0, "mscale_all_dim": 0.707},
        )
    if kind == "kimi_k2":  # Kimi-K2-Instruct's routing and head count, tiny widths
        kimi_yarn = {**yarn, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        return DeepseekV3Config(
            **{**_COMMON, **mla, "num_hidden_layers": 2, "num_attention_heads": 64,
               "num_key_value_heads": 64, "moe_intermediate_size": 8,
               "max_position_embeddings": 128 * 32}, q_lora_rank=48,
            n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
            topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
            rope_parameters=kimi_yarn,
        )
    return DeepseekV3Config(
        **{**_COMMON, **mla}, q_lora_rank=48, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters={**yarn, "mscale": 1.0, "mscale_all_dim": 1.0},
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies use."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + len(chars) - 188)
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges: byte b is token b; specials follow."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
    )


_root: Path | None = None
_dirs: dict[str, Path] = {}


def tiny_model_dir(kind: str = "llama", seed: int = 0) -> Path:
    """A saved tiny checkpoint of ``kind``; built on first use, then reused (per process)."""
    global _root
    key = f"{kind}-{seed}"
    if key in _dirs:
        return _dirs[key]
    from transformers import AutoModelForCausalLM, GenerationConfig

    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="atom-tiny-models-"))
        atexit.register(shutil.rmtree, _root, True)
    path = _root / key
    config = tiny_config(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms, so a wrong norm wiring shows up in the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():  # DeepSeek-V3's bias must change choices
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=256, eos_token_id=EOS_TOKEN_ID, do_sample=True, temperature=0.7, top_p=0.9
    ).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    _dirs[key] = path
    return path


def hf_model(kind: str = "llama", seed: int = 0) -> Any:
    """The transformers model of ``tiny_model_dir(kind)``, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(kind, seed), dtype=torch.float32, attn_implementation="eager"
    ).eval()
