"""ReplayForCausalLM: logits that force a scripted continuation.

The script is a list of token ids: ``{"token_ids": [...]}`` in the JSON file named by
config.json's ``replay_script`` (absolute, or relative to the model directory), else
config.json's own ``replay_token_ids``. The file is re-read whenever a sequence starts, so
a test rewrites it before each request and the running server replays the new text.

Keying the script to a request. A sequence is recognised by its first KV block, and its
prompt length is noted when its prefill arrives; after that the row at position ``p``
predicts ``script[p + 1 - prompt_len]`` (EOS past the end). This holds when:

- each prompt is prefilled in one chunk (``--max-num-batched-tokens`` >= the prompt; a
  final chunk of exactly one token would read as a decode step);
- prefix caching is off (the default), so a prefill starts at position 0 and no two live
  sequences share a first block;
- nothing is preempted (a recomputed sequence starts its script again).

Concurrent requests are fine under those rules; each reads the script current at its
start. The KV cache is real: the runner allocates it for the Attention layer, which runs
on every step and whose output is discarded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom_core.layers.attention.layer import Attention
from atom_core.layers.context import get_forward_context

HEAD_DIM = 8
LOGIT = 50.0  # the script token gets +LOGIT, every other -LOGIT: any sampler picks it


class ReplayForCausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        eos = config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.gain = nn.Parameter(torch.ones(1))  # one real weight, loaded from the checkpoint
        self.attn = Attention(1, HEAD_DIM, HEAD_DIM**-0.5, 1)
        self._seqs: dict[int, tuple[int, list[int]]] = {}  # first block -> (prompt len, script)

    def script(self) -> list[int]:
        path = getattr(self.config, "replay_script", None)
        if path:
            path = Path(path)
            if not path.is_absolute():
                path = Path(getattr(self.config, "_name_or_path", "")) / path
            return list(json.loads(path.read_text())["token_ids"])
        return list(getattr(self.config, "replay_token_ids", None) or [])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        qkv = torch.zeros(input_ids.shape[0], HEAD_DIM, dtype=self.gain.dtype,
                          device=input_ids.device)
        self.attn(qkv, qkv, qkv)  # writes the cache like any model; the result is not needed
        targets = torch.tensor(self._targets(input_ids.tolist()), device=input_ids.device)
        hidden = torch.zeros(input_ids.shape[0], self.vocab_size, dtype=self.gain.dtype,
                             device=input_ids.device)
        hidden[torch.arange(input_ids.shape[0], device=input_ids.device), targets] = 1
        return hidden * self.gain

    def _targets(self, ids: list[int]) -> list[int]:
        """The token each row of the flat batch predicts."""
        meta = get_forward_context()
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        first_blocks = meta.block_tables[:, 0].tolist()
        out: list[int] = []
        for i, seq_len in enumerate(seq_lens):
            n = qsl[i + 1] - qsl[i]
            start = seq_len - n
            key = first_blocks[i]
            if start == 0:  # a new sequence: its script is the one current now
                self._seqs[key] = (seq_len, self.script())
            elif n > 1 and key in self._seqs:  # a later prefill chunk: the prompt is longer
                self._seqs[key] = (seq_len, self._seqs[key][1])
            prompt_len, script = self._seqs.get(key, (seq_len, []))
            for r in range(n):
                k = start + r + 1 - prompt_len
                if k < 0:  # inside the prompt: predict the prompt's own next token
                    out.append(ids[qsl[i] + r + 1])
                else:
                    out.append(script[k] if k < len(script) else self.eos)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return (hidden_states.float() * 2 - 1) * LOGIT

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded

    def attention_layers(self) -> list[Attention]:
        return [self.attn]
