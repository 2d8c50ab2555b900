"""The ``draft_model`` method: any causal LM the engine can load (``--draft-model``), sharing
the target's vocabulary, drafts by running its own greedy decode beside the target."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from atom_core.errors import ConfigError
from atom_core.layers.attention.layer import Attention
from atom_core.spec_decode.proposer import ProposerContext


class CausalLMDraft:
    """A loaded ``CausalLM`` as a ``DraftNetwork``: token p in, token p + 1 out."""

    reads_target_hidden = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, None]:
        return self.model(input_ids, positions), None

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("a draft model does not read the target's hidden states")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return list(self.model.attention_layers())


def load_draft_model(ctx: ProposerContext) -> CausalLMDraft:
    """Load ``--draft-model`` like ``--model`` (same device, dtype and ``--load_dummy``;
    dummy weights seeded apart from the target's) and check it shares the vocabulary."""
    from atom_core.loader import load_model  # the loader imports the plugin registries

    path = ctx.draft_model_path("draft_model")
    m = ctx.config.model_config
    config = dataclasses.replace(ctx.config, model_config=dataclasses.replace(
        m, model=str(path), tokenizer=None, seed=m.seed + 1))
    loaded = load_model(config, ctx.device, ctx.dtype)
    ours, theirs = loaded.hf_config.vocab_size, ctx.target_config.vocab_size
    if ours != theirs:
        raise ConfigError(f"--draft-model {path} has a vocabulary of {ours} tokens, the target "
                          f"{theirs}: a draft model must share the target's vocabulary")
    # It runs at every position the target does.
    positions = getattr(loaded.hf_config, "max_position_embeddings", None)
    needed = ctx.config.scheduler_config.max_model_len
    if positions is not None and needed is not None and positions < needed:
        raise ConfigError(f"--draft-model {path} handles {positions} positions, fewer than "
                          f"--max-model-len {needed}; lower --max-model-len")
    return CausalLMDraft(loaded.model)
