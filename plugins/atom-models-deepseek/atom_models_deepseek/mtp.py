"""DeepSeek-V3's multi-token prediction (MTP) module as a draft network: ``--method mtp``.

A DeepSeek-V3 (or R1) checkpoint appends ``num_nextn_predict_layers`` MTP modules after its
``num_hidden_layers`` decoder layers, named as the next layers: ``model.layers.{N}.`` with
N = num_hidden_layers for the first. Each holds ``embed_tokens`` (a copy of the target's),
``enorm`` / ``hnorm`` (RMSNorms), ``eh_proj`` [hidden, 2 * hidden] (no bias), one full
DeepSeek decoder block (MLA attention; MoE or dense MLP as the target's layer N would be:
``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``) and
``shared_head`` (``norm``, ``head`` [vocab, hidden], a copy of the target's ``lm_head``).

At position p it reads token t(p+1) and the target's hidden state h(p) (its output after
the final norm, as vLLM and SGLang feed it) and predicts t(p+2)::

    x = eh_proj(cat([enorm(embed(t(p+1))), hnorm(h(p))], -1))
    y = block(x)                       # attention + MLP, each with its residual add
    logits = shared_head.head(shared_head.norm(y))

y is both the rows to take logits from and the hidden state the next draft step reads: k
drafts run the first MTP module k times, autoregressively, as vLLM does (deeper modules,
where a checkpoint has them, are not used).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom_core.errors import ConfigError
from atom_core.layers.attention.mla import MLAAttention
from atom_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.layers.linear import ReplicatedLinear
from atom_core.layers.moe import load_hf_moe_weights
from atom_core.layers.norm import RMSNorm
from atom_core.spec_decode.proposer import ProposerContext, checkpoint_tensors
from atom_models_deepseek.model import GATE_UP_PARAMS, DeepseekV2ForCausalLM, deepseek_layer

# The checkpoint names the block's parts directly under the layer; this module holds them
# as ``block`` (the core's DecoderLayer).
BLOCK_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")


class SharedHead(nn.Module):
    """``head(norm(x))``; ``head`` is the checkpoint's own, or the target's ``lm_head``
    (``borrowed``), which is then held outside the registered submodules."""

    def __init__(self, config: Any, borrowed: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if borrowed is None:
            self.head = ParallelLMHead(config.vocab_size, config.hidden_size)
        # A tuple, so nn.Module does not register it: dummy initialisation and loading
        # walk registered parameters only, and must not touch the target's.
        self._borrowed = (borrowed,) if borrowed is not None else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = self._borrowed[0] if self._borrowed else self.head
        return head(self.norm(x))


class DeepseekMTP(nn.Module):
    """One DeepSeek-V3 MTP module (see the module docstring). ``embed`` / ``head``: the
    target's embedding and LM head to share where the checkpoint has no copy of its own
    (None builds one)."""

    def __init__(
        self, config: Any, layer_idx: int, version: int, is_neox: bool,
        embed: nn.Module | None = None, head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        if embed is None:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self._borrowed_embed = (embed,) if embed is not None else ()  # unregistered, as above
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.block = deepseek_layer(config, layer_idx, version, is_neox)
        self.shared_head = SharedHead(config, head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self._borrowed_embed[0] if self._borrowed_embed else self.embed_tokens
        return embed(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """[T] tokens t(p+1), positions p and [T, H] hidden states h(p) -> [T, H] block
        output (before ``shared_head.norm``)."""
        e = self.enorm(self.embed(input_ids))
        h = self.hnorm(hidden)
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        out, residual = self.block(positions, x, None)  # the block leaves its last add to us
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head(hidden)

    def attention(self) -> MLAAttention:
        return self.block.self_attn.mla_attn


class MTPDraft:
    """A ``DeepseekMTP`` as the engine's ``DraftNetwork`` (atom_core/spec_decode/proposer.py):
    it reads the target's final hidden states and feeds its own output to the next step."""

    reads_target_hidden = True

    def __init__(self, module: DeepseekMTP) -> None:
        self.module = module

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden is None:
            raise ValueError("the MTP module needs the previous hidden states")
        out = self.module(input_ids, positions, hidden)
        return out, out

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module.compute_logits(hidden)

    def attention_layers(self) -> list[MLAAttention]:
        return [self.module.attention()]


def checkpoint_name_to_param(name: str) -> str:
    """A tensor name under ``model.layers.{N}.`` -> this module's parameter name."""
    return f"block.{name}" if name.split(".", 1)[0] in BLOCK_PARTS else name


def _tensor_names(path: Path, prefix: str) -> set[str]:
    """The checkpoint's tensor names under ``prefix`` (prefix removed), from the shards'
    headers alone."""
    from safetensors import safe_open

    from atom_core.loader import hf_dir

    names: set[str] = set()
    for file in hf_dir.safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.update(n[len(prefix):] for n in f.keys() if n.startswith(prefix))
    return names


def load_mtp(ctx: ProposerContext) -> MTPDraft:
    """The target checkpoint's first MTP module, built beside the target (its device and
    dtype), with the target's embedding / LM head shared where the checkpoint has no copy
    (always under ``--load_dummy``, whose weights are random anyway)."""
    target, config = ctx.target, ctx.target_config
    if not isinstance(target, DeepseekV2ForCausalLM):
        raise ConfigError(
            "--method mtp drafts with a DeepSeek-V3 checkpoint's multi-token-prediction "
            f"layers; the target is {type(target).__name__}, not a DeepSeek-V2/V3 model")
    depth = getattr(config, "num_nextn_predict_layers", None) or 0
    if depth < 1:
        raise ConfigError(
            "--method mtp needs a checkpoint with multi-token-prediction layers; this "
            f"{type(target).__name__} config has num_nextn_predict_layers="
            f"{getattr(config, 'num_nextn_predict_layers', None)} (DeepSeek-V3 and R1 have 1)")
    index = config.num_hidden_layers
    prefix = f"model.layers.{index}."
    path = ctx.target_checkpoint()
    dummy = ctx.config.model_config.load_dummy is not None
    names: set[str] = set()
    if not dummy:
        if path is None:
            raise ConfigError(
                "--method mtp reads the MTP layer from the target's Hugging Face directory; "
                f"--model {ctx.config.model_config.model} is not one")
        names = _tensor_names(path, prefix)
        if not names:
            raise ConfigError(
                f"{path} has no multi-token-prediction weights ({prefix}*) although its config "
                f"sets num_nextn_predict_layers={depth}: --method mtp needs them")
    embed = None if "embed_tokens.weight" in names else target.model.embed_tokens
    head = None if "shared_head.head.weight" in names else target.lm_head
    version, is_neox = type(target).version, target.rope_is_neox(config)
    module = ctx.build(lambda: DeepseekMTP(config, index, version, is_neox, embed, head))
    assert isinstance(module, DeepseekMTP)

    def load() -> set[str]:
        assert path is not None
        tensors = ((checkpoint_name_to_param(n), t) for n, t in checkpoint_tensors(path, prefix))
        return load_hf_moe_weights(module, tensors, GATE_UP_PARAMS)

    ctx.fill(module, load, f"hf:{path} ({prefix}*)")
    return MTPDraft(module)
