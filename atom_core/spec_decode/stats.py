"""Speculative decoding's acceptance statistics: kept by the engine, rebuilt by the server
from the counts the engine process sends (no torch here: the HTTP frontend imports it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

LOG_EVERY_DRAFTS = 1000


@dataclass
class SpecDecodeStats:
    """Draft and acceptance counts since start (the guide's MTP statistics)."""

    num_speculative_tokens: int
    total_draft_tokens: int = 0
    total_accepted_tokens: int = 0
    num_verifications: int = 0  # sequence-forwards that verified drafts
    accepted_per_position: list[int] = field(default_factory=list)
    _next_log: int = LOG_EVERY_DRAFTS

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.total_draft_tokens += num_drafts
        self.total_accepted_tokens += num_accepted
        self.num_verifications += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
        if self.total_draft_tokens >= self._next_log:
            self._next_log += LOG_EVERY_DRAFTS
            logger.info("speculative decoding: %s", self.summary_line())

    @property
    def acceptance_rate(self) -> float:
        drafted = self.total_draft_tokens
        return self.total_accepted_tokens / drafted if drafted else 0.0

    @property
    def average_tokens_per_forward(self) -> float:
        """Tokens a verifying forward emits per sequence: 1 + accepted drafts."""
        if not self.num_verifications:
            return 0.0
        return 1.0 + self.total_accepted_tokens / self.num_verifications

    def summary_line(self) -> str:
        return (f"{self.total_draft_tokens} draft tokens, {self.total_accepted_tokens} accepted "
                f"({self.acceptance_rate:.2%}), {self.average_tokens_per_forward:.2f} tokens "
                "per forward")

    def as_dict(self) -> dict[str, Any]:
        per_position = [a / self.num_verifications if self.num_verifications else 0.0
                        for a in self.accepted_per_position]
        return {
            "total_draft_tokens": self.total_draft_tokens,
            "total_accepted_tokens": self.total_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "average_tokens_per_forward": self.average_tokens_per_forward,
            "num_verifications": self.num_verifications,
            "acceptance_per_position": per_position,
        }

    def report(self) -> str:
        return ("MTP Statistics:\n"
                f"  Total draft tokens: {self.total_draft_tokens}\n"
                f"  Accepted tokens:    {self.total_accepted_tokens}\n"
                f"  Acceptance rate:    {self.acceptance_rate:.2%}\n"
                f"  Tokens per forward: {self.average_tokens_per_forward:.2f}")
