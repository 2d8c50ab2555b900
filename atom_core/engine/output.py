"""A request's output text: incremental detokenization, stop strings, and the finish
reason a stop string gives. One path for both consumers of the engine's tokens: LLMEngine
feeds ``RequestText`` each step's token in-process; the server's EngineClient feeds it the
tokens each engine step sends from the engine process (which sends ids, never text).

Decoding only the newest tokens, against a few tokens of context, keeps the cost per
token constant. A UTF-8 character split across tokens decodes to U+FFFD until its last
byte comes, so text ending in U+FFFD is held back. Byte-level BPE tokenizers (GPT-2's
decoder: Llama 3, Qwen, DeepSeek, gpt-oss, SmolLM2) decode bytes as Rust's lossy UTF-8
does, one U+FFFD per invalid run, and an unfinished character is the one U+FFFD at the
end: for them only that last character is held, so bytes that never form UTF-8 do not
hold a stream back until it ends. Byte-fallback decoders (SentencePiece's: a run of byte
tokens that is not all valid UTF-8 decodes to one U+FFFD per byte, and a later byte can
turn them all into characters) keep the whole trailing text held. A finished request's
text is the decode of all its tokens, a U+FFFD for an unfinished last character
included. With stop strings, the last
``len(longest stop) - 1`` characters are withheld until they cannot start one, so a stop
string split across tokens never leaks into streamed output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import decoders

from atom_core.sampling_params import SamplingParams

# Tokens of prompt kept as context, so a word-initial space decodes as it would mid-text.
CONTEXT_TOKENS = 5


def decodes_bytes_lossily(tokenizer: Any) -> bool:
    """The tokenizer decodes with GPT-2's byte-level decoder: an invalid byte run becomes
    one U+FFFD that no later byte changes, and an unfinished character one at the end."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


def fast_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` for lists of ids, calling the Rust backend directly when
    transformers would add nothing to it (no ``clean_up_tokenization_spaces``): two decodes
    run per generated token, and transformers' Python wrapper around each costs ~5x the
    decode itself, which at batch 32 was most of the engine's per-step host time."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    else:
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return decode


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop_strings: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._decode = fast_decoder(tokenizer, skip_special_tokens)
        self.stop_strings = [s for s in (stop_strings or []) if s]
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.text = ""
        self.released = 0  # characters of self.text already handed out
        self.stopped_on: str | None = None
        # Characters past read_offset's text already in self.text: those before a trailing
        # U+FFFD, taken while the tokens after read_offset do not decode clean.
        self.partial = 0
        self.lossy = decodes_bytes_lossily(tokenizer)

    def add_token(self, token_id: int) -> None:
        """Feed one generated token; afterwards check ``stopped_on``."""
        if self.stopped_on is not None:
            return
        self.ids.append(token_id)
        full, start = self._window()
        if len(full) <= start:
            return  # a token that decodes to nothing yet
        new = full[start:]
        if not new.endswith("\ufffd"):
            self._commit(new)
            return
        if not self.lossy:
            return  # any of the trailing text may still change
        self._take(new[:-1])  # the last character may still be unfinished
        if len(self.ids) - self.read_offset > 4:
            self._skip_ahead(full, start)

    def _window(self) -> tuple[str, int]:
        """The decode of the tokens from prefix_offset on, and how many of its characters
        the tokens before read_offset make (they are context, already in self.text)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        return self._decode(self.ids[self.prefix_offset :]), len(prefix)

    def _commit(self, new: str) -> None:
        """Take ``new``, the final text of every token past read_offset, and move past them."""
        self._take(new)
        self.prefix_offset, self.read_offset, self.partial = self.read_offset, len(self.ids), 0

    def _take(self, new: str) -> None:
        """Append what ``new`` (the text past read_offset's) has beyond ``partial``."""
        if len(new) > self.partial:
            start = len(self.text)
            self.text += new[self.partial :]
            self._check_stop(start)
        self.partial = len(new)

    def _skip_ahead(self, full: str, prefix_len: int) -> None:
        """Move read_offset up to 3 tokens short of the end where the text up to there is
        final (a string prefix of ``full``), so a long run of bytes that are no UTF-8 is not
        decoded again whole at every token. An unfinished character has at most 3 bytes,
        so it starts within the last 3 tokens."""
        cut = len(self.ids) - 3
        head = self._decode(self.ids[self.prefix_offset : cut])
        taken = len(head) - prefix_len
        if full.startswith(head) and 0 <= taken <= self.partial:
            self.partial -= taken
            self.prefix_offset, self.read_offset = self.read_offset, cut

    def _check_stop(self, new_from: int) -> None:
        if not self.stop_strings:
            return
        # A stop string may straddle the old text and the new: search from hold chars back.
        search_from = max(0, new_from - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stop_strings:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s) if self.include_stop else i]
            self.stopped_on = s

    def flush(self) -> str:
        """All text not yet released (the request finished), an unfinished last character
        as the U+FFFD that the decode of all the tokens ends in."""
        if self.stopped_on is None and len(self.ids) > self.read_offset:
            full, start = self._window()
            self._commit(full[start:])
        out = self.text[self.released :]
        self.released = len(self.text)
        return out

    def release(self) -> str:
        """Text that can no longer become part of a stop string."""
        if self.stopped_on is not None:
            return self.flush()
        end = len(self.text) - self.hold
        if end <= self.released:
            return ""
        out = self.text[self.released : end]
        self.released = end
        return out


class RequestText(IncrementalDetokenizer):
    """One request's text, fed its tokens as the engine produces them.

    ``update`` takes a step's new tokens and the engine's finish_reason (None while the
    request runs), and returns ``(text, finish_reason, stop_reason)``: the text those
    tokens release and how the request ends, if it does. The token that ends a request
    with "stop" and no stop string (EOS, a stop token id) is not part of its text. A stop
    string ends the request here: finish_reason "stop", the string as stop_reason. A
    finished request's text is released whole; before that, what could still begin a
    stop string is held back. (A subclass, not a wrapper: this runs once per token.)
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(
            tokenizer, prompt_token_ids, params.stop_strings, params.include_stop_str_in_output,
            params.skip_special_tokens,
        )

    def update(
        self,
        token_ids: list[int],
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> tuple[str, str | None, int | str | None]:
        if finish_reason == "stop" and token_ids and not isinstance(stop_reason, str):
            token_ids = token_ids[:-1]
        for token_id in token_ids:
            self.add_token(token_id)
            if self.stopped_on is not None:
                break
        text = self.flush() if finish_reason is not None else self.release()
        if self.stopped_on is not None:  # found in the tokens, or in the text flush completed
            finish_reason, stop_reason = "stop", self.stopped_on
        return text, finish_reason, stop_reason
