"""What a speculative-decoding method registered through ``register_spec_decode_proposers``
provides.

``register(method, factory)``; the engine calls ``factory(ProposerContext)`` once at start
and gets one of two kinds of proposer:

- a ``TokenProposer`` drafts from the token history alone (``ngram``);
- a ``DraftNetwork`` is a small model run beside the target (``draft_model``, ``mtp``,
  ``eagle3``). The engine gives its attention layers their own KV cache over the target's
  block tables, runs it over every row the target computes (so its cache always covers
  what the target's does), then k - 1 more single-token steps, and takes each step's
  argmax as a draft (engine/drafter.py).

A network that ``reads_target_hidden`` (MTP, EAGLE) sees, at position p, token p + 1 and
the target's hidden state at p, and predicts token p + 2; one that does not (a draft
model) sees token p and predicts p + 1, like any causal LM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from atom_core.config import Config
from atom_core.errors import ConfigError
from atom_core.layers.attention.layer import Attention
from atom_core.layers.context import BuildContext, build_context


@runtime_checkable
class TokenProposer(Protocol):
    def propose(self, token_ids_per_seq: list[list[int]], k: int) -> list[list[int]]:
        """Up to k draft tokens per sequence (fewer, or none, where it has no guess)."""
        ...


@runtime_checkable
class DraftNetwork(Protocol):
    reads_target_hidden: bool

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T] ids and positions (and, where it reads them, [T, H] hidden states: the
        target's from ``target_hidden`` on the first step, its own after) -> (the rows for
        ``compute_logits``, the hidden states its next step reads, or None)."""
        ...

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target forward's output [T, H] -> this network's hidden input for the same
        rows (EAGLE-3 reads the layers it asked the target to keep instead)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, target vocabulary] logits (a smaller draft vocabulary mapped in)."""
        ...

    def attention_layers(self) -> list[Attention]:
        ...


@dataclass
class ProposerContext:
    """What a proposer factory may use: the flags, the target and where to build."""

    config: Config
    target: nn.Module
    target_config: Any  # the target's transformers config
    device: torch.device
    dtype: torch.dtype

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.speculative_config.num_speculative_tokens

    def draft_model_path(self, method: str) -> Path:
        """``--draft-model``, which ``method`` needs."""
        path = self.config.speculative_config.draft_model
        if path is None:
            raise ConfigError(f"--method {method} needs --draft-model")
        found = Path(path).expanduser()
        if not found.exists():
            raise ConfigError(f"--draft-model {found} does not exist")
        return found

    def target_checkpoint(self) -> Path | None:
        """The target's Hugging Face directory, where its weights are read from one (not
        for dummy weights, a GGUF file or the embedded default)."""
        m = self.config.model_config
        if m.load_dummy is not None or m.model is None:
            return None
        path = Path(m.model).expanduser()
        return path if path.is_dir() else None

    def build(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """``factory()`` constructed on the target's device in its dtype, its layers
        resolving ops and attention backends as the target's did."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), build_context(BuildContext(self.device, self.dtype)):
                module = factory()
        finally:
            torch.set_default_dtype(previous)
        return module.eval()

    def fill(self, module: nn.Module, load: Callable[[], set[str]], source: str) -> None:
        """Fill ``module``'s weights: dummy ones under ``--load_dummy`` (seeded apart from
        the target's), else ``load()``, which returns the names it filled; a name left
        unfilled is an error. Parts shared with the target (an embedding, a head) are held
        outside ``module``'s registered submodules, so neither touches them."""
        from atom_core.loader.dummy import init_dummy_weights

        dummy = self.config.model_config.load_dummy
        if dummy is not None:
            loaded = init_dummy_weights(module, dummy, self.config.model_config.seed + 1)
        else:
            loaded = load()
        missing = sorted({n for n, _ in module.named_parameters()} - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ConfigError(f"{source} lacks {len(missing)} of the draft's weights: {shown}")


def checkpoint_tensors(path: Path, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the Hugging Face checkpoint at ``path`` whose names start with
    ``prefix``, with it removed."""
    from atom_core.loader import hf_dir

    for name, tensor in hf_dir.iter_weights(path):
        if name.startswith(prefix):
            yield name[len(prefix):], tensor


ProposerFactory = Callable[[ProposerContext], "TokenProposer | DraftNetwork"]
