"""The ``eagle3`` method: an EAGLE-3 draft head (``--draft-model DIR``) beside a Llama-style
target, in the published layout (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

The draft reads, for the row of position p, the token at p + 1 and a hidden state: on the
first step ``fc`` over the target's residual stream entering three of its layers
(``eagle_config.eagle_aux_hidden_state_layer_ids``, by default 2, N // 2 and N - 3 of the
target's N layers), on later steps its own pre-norm output at p - 1. One decoder layer
whose attention reads [input_layernorm(embed(token)), hidden_norm(hidden)] (2 x hidden
wide), with the hidden state as its residual, then the final norm and a head over a
smaller draft vocabulary; ``d2t`` maps draft id i to target id i + d2t[i].

Checkpoint tensors: ``midlayer.*`` (the layer, q/k/v/gate/up separate), ``fc.weight``
[hidden, 3 x target hidden], ``norm.weight``, ``lm_head.weight`` [draft vocab, hidden],
``d2t`` [draft vocab] int64, ``t2d`` (unused), and ``embed_tokens.weight`` where the draft
has its own embedding (else it reads the target's).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom_core.errors import ConfigError
from atom_core.layers.attention.layer import Attention
from atom_core.layers.decoder import DecoderModel
from atom_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_core.layers.model_api import load_hf_weights
from atom_core.layers.norm import RMSNorm
from atom_core.layers.rotary import get_rope, rope_config
from atom_core.spec_decode.proposer import ProposerContext, checkpoint_tensors
from atom_models_llama.model import llama_mlp

ARCHITECTURE = "LlamaForCausalLMEagle3"


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the concatenated 2 x hidden input."""

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(2 * hidden, head_dim, num_heads, num_kv_heads, bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        base, rope_scaling = rope_config(config)
        rope = get_rope(head_dim, head_dim, max_position, base, rope_scaling)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5,
                              self.qkv_proj.num_kv_heads, rope=rope)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        return self.o_proj(self.attn(q, k, v, positions))


class Eagle3Layer(nn.Module):
    """The draft's one decoder layer (``midlayer``)."""

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config, max_position)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = llama_mlp(config)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), hidden)
        return self.mlp(x), residual


class Eagle3Model(nn.Module):
    """The draft checkpoint's tensors, by their names. The target's embedding, where the
    draft reads it, is not a submodule: loading and dummy weights never reach it."""

    def __init__(self, config: Any, fc_inputs: int, own_embedding: bool,
                 max_position: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.vocab_size = config.vocab_size
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, hidden)
                             if own_embedding else None)
        self.midlayer = Eagle3Layer(config, max_position)
        self.fc = ReplicatedLinear(fc_inputs, hidden)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        # Target id of each draft id (arange + d2t); None while the vocabularies coincide.
        self.target_ids: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed rows for the head, their pre-norm sum: the next step's hidden input)."""
        out, residual = self.midlayer(positions, embeds, hidden)
        return self.norm(out, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.target_ids is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.target_ids, logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        d2t: torch.Tensor | None = None

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal d2t
            for name, tensor in weights:
                if name == "d2t":
                    d2t = tensor
                elif name != "t2d":  # the inverse map: drafting has no use for it
                    yield name, tensor

        loaded = load_hf_weights(self, tensors())
        if d2t is None and self.draft_vocab_size != self.vocab_size:
            raise ConfigError(f"no d2t for a draft vocabulary of {self.draft_vocab_size} tokens "
                              f"(the target's has {self.vocab_size})")
        self.set_vocabulary_map(d2t)
        return loaded

    def set_vocabulary_map(self, d2t: torch.Tensor | None) -> None:
        """Draft id i scores target id i + d2t[i]; no map means the first ids."""
        n = self.draft_vocab_size
        if d2t is None:
            d2t = torch.zeros(n, dtype=torch.long)
        if tuple(d2t.shape) != (n,):
            raise ConfigError(f"d2t has shape {tuple(d2t.shape)}, the draft vocabulary {n}")
        ids = torch.arange(n) + d2t.to("cpu", torch.long)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ConfigError(f"d2t maps draft ids outside the vocabulary of {self.vocab_size}")
        if ids.unique().numel() != n:
            raise ConfigError("d2t maps two draft ids onto one target id")
        identity = n == self.vocab_size and bool((ids == torch.arange(n)).all())
        self.target_ids = None if identity else ids.to(self.lm_head.weight.device)


class Eagle3Draft:
    """An ``Eagle3Model`` as a ``DraftNetwork``, reading its target's layer inputs."""

    reads_target_hidden = True

    def __init__(self, model: Eagle3Model, target: DecoderModel) -> None:
        self.model = model
        self.target = target
        self.embed = model.embed_tokens if model.embed_tokens is not None else target.embed_tokens

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert hidden is not None
        return self.model(positions, self.embed(input_ids), hidden)

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over the layer inputs the target kept in its last forward (``hidden``,
        its output, is not what EAGLE-3 reads)."""
        return self.model.fc(torch.cat(self.target.aux_hidden_states, dim=-1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [self.model.midlayer.self_attn.attn]


def read_config(path: Path) -> Any:
    from transformers import LlamaConfig

    try:
        config = LlamaConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read an EAGLE-3 config from {path}: {exc}") from exc
    if ARCHITECTURE not in (getattr(config, "architectures", None) or []):
        raise ConfigError(f"--draft-model {path} is not an EAGLE-3 draft (architectures "
                          f"{config.architectures}, expected [{ARCHITECTURE!r}])")
    return config


def aux_layer_ids(config: Any, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs ``fc`` reads, in layer order (as the draft was
    trained: the residual streams concatenated from the lowest layer up)."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_layers // 2, target_layers - 3)
    if not all(0 <= i < target_layers for i in ids):
        raise ConfigError(f"EAGLE-3 reads the inputs of target layers {list(ids)}; the target "
                          f"has {target_layers} layers (set eagle_config."
                          "eagle_aux_hidden_state_layer_ids)")
    return tuple(sorted(ids))


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the safetensors headers (nothing loaded)."""
    from safetensors import safe_open

    from atom_core.loader.hf_dir import safetensors_files

    shapes = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def load_eagle3(ctx: ProposerContext) -> Eagle3Draft:
    """Build and fill the draft of ``--draft-model``, checked against the target, and set
    the target to keep the layer inputs it reads."""
    path = ctx.draft_model_path("eagle3")
    config = read_config(path)
    stack = getattr(ctx.target, "model", None)
    if not isinstance(stack, DecoderModel):
        raise ConfigError(f"--method eagle3 needs a target built on the core's DecoderModel; "
                          f"{type(ctx.target).__name__} is not")
    target = ctx.target_config
    if getattr(config, "num_hidden_layers", 1) != 1:
        raise ConfigError(f"{path}: EAGLE-3 drafts of {config.num_hidden_layers} layers are not "
                          "supported (only one)")
    if getattr(config, "norm_before_residual", False):
        raise ConfigError(f"{path}: norm_before_residual drafts are not supported")
    if config.vocab_size != target.vocab_size:
        raise ConfigError(f"--draft-model {path} has a vocabulary of {config.vocab_size} tokens, "
                          f"the target {target.vocab_size}: an EAGLE-3 draft must share the "
                          "target's vocabulary")
    ids = aux_layer_ids(config, len(stack.layers))
    fc_inputs = len(ids) * target.hidden_size
    dummy = ctx.config.model_config.load_dummy is not None
    shapes = {} if dummy else checkpoint_shapes(path)
    fc = shapes.get("fc.weight")
    if fc is not None and fc[1] != fc_inputs:
        raise ConfigError(f"{path}: fc takes {fc[1]} inputs; the target's hidden size "
                          f"{target.hidden_size} x {len(ids)} layers read is {fc_inputs}")
    draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
    head = shapes.get("lm_head.weight")
    if head is not None and head != (draft_vocab, config.hidden_size):
        raise ConfigError(f"{path}: lm_head.weight is {list(head)}, the config says "
                          f"[{draft_vocab}, {config.hidden_size}] (draft_vocab_size, hidden)")
    own_embedding = "embed_tokens.weight" in shapes
    if not own_embedding and config.hidden_size != target.hidden_size:
        raise ConfigError(f"{path}: a draft of hidden size {config.hidden_size} without an "
                          f"embedding of its own cannot read the target's ({target.hidden_size})")
    # The draft's config may name a shorter context than the target serves (the published
    # Llama 3.1 draft says 2048): its rotary table covers the target's.
    max_position = max(config.max_position_embeddings,
                       getattr(target, "max_position_embeddings", 0))
    model = ctx.build(lambda: Eagle3Model(config, fc_inputs, own_embedding, max_position))
    assert isinstance(model, Eagle3Model)

    def load() -> set[str]:
        try:
            return model.load_weights(checkpoint_tensors(path, ""))
        except ConfigError:
            raise
        except (KeyError, ValueError) as exc:  # a name or shape that does not fit
            raise ConfigError(f"--draft-model {path}: {exc}") from exc

    ctx.fill(model, load, f"--draft-model {path}")
    if dummy:
        model.set_vocabulary_map(None)
    stack.aux_hidden_layers = ids
    return Eagle3Draft(model, stack)
