"""The state of one request inside the engine."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from atom_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_core.structured.matcher import GrammarMatcher


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Logprob:
    """A position's sampled (or prompt) token logprob and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class RequestTimings:
    """When a request reached each point in the engine: ``time.monotonic()`` seconds, a
    clock every process on the host shares, so the frontend can set these beside its own."""

    arrival: float
    scheduled: float | None  # first scheduled (a preemption does not move it)
    first_token: float | None  # on the host, read back from the device
    second_token: float | None
    finished: float | None


_ids = itertools.count()
PLACEHOLDER_TOKEN = -1  # never a vocabulary id: prompts are validated to [0, vocab)


class Sequence:
    """Tokens, KV blocks and progress of one request.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix-cache hits
    included); a step computes ``token_ids[num_computed_tokens : +n]``. Prefill is done
    when it reaches ``num_tokens`` - each decode step then computes the one newest token.
    """

    def __init__(
        self, token_ids: list[int], sampling_params: SamplingParams, request_id: str | None = None
    ):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits at the last allocation
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[Logprob] = []
        self.prompt_logprobs: list[Logprob | None] = []
        self.num_preemptions = 0
        self.spec_tokens: list[int] = []  # draft tokens the next step verifies
        # Where the output is in its request's grammar (structured outputs), else None.
        self.grammar: GrammarMatcher | None = None
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.second_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getstate__(self) -> dict[str, Any]:
        # A step's sequences are pickled to tensor-parallel workers; a matcher does not
        # pickle, and only rank 0 masks its logits.
        return {**self.__dict__, "grammar": None}

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._stamp_token()

    def append_placeholder(self) -> None:
        """Stand in for a token a queued step is still sampling (--async-scheduling): lengths,
        positions and slots are right; the value is read only once ``resolve_placeholder``
        has replaced it (the device feeds the real id to the next step itself)."""
        self.token_ids.append(PLACEHOLDER_TOKEN)

    def resolve_placeholder(self, token_id: int) -> None:
        assert self.token_ids[-1] == PLACEHOLDER_TOKEN, "no placeholder to resolve"
        self.token_ids[-1] = token_id
        self._stamp_token()  # a step queued ahead: its token arrives now

    def _stamp_token(self) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        elif self.second_token_time is None and self.num_output_tokens >= 2:
            self.second_token_time = time.monotonic()

    def mark_scheduled(self) -> None:
        if self.scheduled_time is None:
            self.scheduled_time = time.monotonic()

    def timings(self) -> RequestTimings:
        return RequestTimings(self.arrival_time, self.scheduled_time, self.first_token_time,
                              self.second_token_time, self.finish_time)

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def num_blocks(self, block_size: int) -> int:
        return (self.num_tokens + block_size - 1) // block_size
