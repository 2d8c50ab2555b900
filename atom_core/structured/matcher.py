"""One sequence's place in its grammar (``GrammarMatcher``) and the step's batched
next-token bitmask (``fill_bitmask``).

The bitmask is llguidance's (and xgrammar's) layout: int32 words, bit ``t % 32`` of word
``t // 32`` set where token ``t`` may come next. It is filled on the host, where the
matchers live, by llguidance's thread pool (which drops the GIL), and sent to the logits'
device in one copy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the frontend imports this package for StructuredSpec, and needs no torch
    import torch

logger = logging.getLogger(__name__)

_executor: Any = None


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """Which tokens may come next, and the advance by the sampled one.

    It lives on the engine's Sequence and follows its output tokens only: a preempted
    sequence recomputes its KV but keeps its tokens, so it keeps its matcher as it is.
    """

    def __init__(self, matcher: Any) -> None:
        self._ll = matcher  # an llguidance.LLMatcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; True when it ends the sequence: the grammar took it as
        EOS (so it ends the sequence even under ignore_eos). A token the grammar refuses -
        never sampled under the mask - ends it too, logged.

        A complete match does not end the sequence by itself: the next step's mask then
        holds EOS alone, which is sampled whatever the temperature. The sequence so ends
        on EOS as an unconstrained one does (its last token not part of the text), and
        its text holds every token of the match."""
        complete = self._ll.is_stopped()  # then EOS is the one token left to take
        if not self._ll.consume_token(token):
            logger.error("token %d is outside the request's grammar: %s", token,
                         self._ll.get_error())
            return True
        return complete or self._ll.stop_reason() == "EndOfSentence"

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS may come next)."""
        return self._ll.is_accepting()


def fill_bitmask(matchers: list[GrammarMatcher], vocab_size: int,
                 pin: bool = False) -> torch.Tensor:
    """[len(matchers), bitmask_width(vocab_size)] int32 on the host: row i is
    ``matchers[i]``'s next-token bitmask. ``pin``: in page-locked memory, for an
    asynchronous copy to a GPU."""
    import torch

    global _executor
    width = bitmask_width(vocab_size)
    out = torch.empty((len(matchers), width), dtype=torch.int32, pin_memory=pin)
    if len(matchers) == 1:  # no hand-over to the pool
        matchers[0]._ll.unsafe_compute_mask_ptr(out.data_ptr(), width * 4)
        return out
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._ll, i) for i, m in enumerate(matchers)],
                                      out.data_ptr(), width * 4, len(matchers))
    return out
