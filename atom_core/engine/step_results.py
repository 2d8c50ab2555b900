"""What a step leaves for the host: ``PendingStep`` (queued, its ids not read yet) and
``StepOutput`` (read)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atom_core.engine.sequence import Logprob, Sequence


@dataclass
class PendingStep:
    """A step queued on the device whose sampled ids the host has not read yet."""

    seqs: list[Sequence]  # the sequences that sample, in the order of ``sampled``
    sampled: torch.Tensor  # [n] device ids: the next step's input ids, without a host trip
    host: torch.Tensor  # [n] pinned buffer the ids are being copied into
    ready: torch.cuda.Event | None  # recorded after that copy (None on CPU: copies are sync)
    logprobs: list[Logprob | None]
    prompt_logprobs: dict[int, list[Logprob | None]] = field(default_factory=dict)
    # Speculative decoding (read on the host already): every token each verifying
    # sequence emits, and its accepted drafts, by sequence id.
    emitted: dict[int, list[int]] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # a draft network's


@dataclass
class StepOutput:
    """What one forward produced, per sequence of the batch that sampled."""

    sampled: dict[int, int]  # seq_id -> token id
    logprobs: dict[int, Logprob]
    prompt_logprobs: dict[int, list[Logprob | None]]
    emitted: dict[int, list[int]] = field(default_factory=dict)  # speculative: all tokens
    accepted: dict[int, int] = field(default_factory=dict)  # speculative: drafts accepted
    drafts: dict[int, list[int]] = field(default_factory=dict)  # a draft network's proposals
