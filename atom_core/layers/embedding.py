"""Token embedding and the LM head, with the vocabulary split across tensor-parallel ranks.

The LM head's product is the registry's ``linear`` op, like every linear layer's: at decode
it streams the whole [vocab, hidden] weight for a few rows (311 MB on Qwen3-0.6B).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.distributed.collectives import all_gather_last, all_reduce
from atom_core.distributed.state import tp_rank_and_size
from atom_core.layers.context import get_build_context
from atom_core.layers.linear import Fp8Quantizable, default_weight_loader
from atom_core.ops import resolve_op


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of vocabulary rows.

    With TP > 1, ids outside this rank's range embed to zero and an all-reduce sums the
    ranks; with TP = 1 this is a plain embedding lookup.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # Pad so every rank gets the same number of rows.
        self.num_embeddings_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        rows = min(self.num_embeddings_per_rank, loaded_weight.shape[0] - self.vocab_start)
        if self.tp_size == 1 and rows == param.shape[0]:
            return default_weight_loader(param, loaded_weight)
        param.data.narrow(0, rows, param.shape[0] - rows).zero_()
        default_weight_loader(
            param.data.narrow(0, 0, rows), loaded_weight.narrow(0, self.vocab_start, rows)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.num_embeddings_per_rank)
        out = F.embedding(local.clamp(0, self.num_embeddings_per_rank - 1), self.weight)
        return all_reduce(out * mask.unsqueeze(-1).to(out.dtype))

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class ParallelLMHead(Fp8Quantizable, VocabParallelEmbedding):
    """Hidden states -> logits over the vocabulary, in the model's dtype: the sampler widens
    them to fp32 where it computes on them, and greedy decoding takes the argmax of the
    narrow ones (the same token), so a decode step has no [batch, vocab] copy to fp32.

    ``tie_to(embedding)`` shares the embedding's weight (``tie_word_embeddings``), so the
    checkpoint's ``lm_head.weight``, if present at all, is redundant. Quantizing a tied
    head gives it a weight of its own (the embedding keeps the model dtype).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.tied = False
        self._linear = resolve_op("linear", get_build_context().device)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self._linear(hidden_states, self.op_weight, self.bias)
        if self.tp_size == 1:
            return logits
        # Every rank gets the whole vocabulary's logits: the ranks' slices side by side, the
        # padding rows of the last slice cut off.
        return all_gather_last(logits)[..., : self.num_embeddings]
