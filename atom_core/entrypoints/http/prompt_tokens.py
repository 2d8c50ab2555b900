"""Prompt text -> token ids for the HTTP handlers, off the event loop and bounded by the
context.

Tokenizing runs ~1 MB/s on a 2-core VM, so a 30 MB prompt costs half a minute of CPU
before it can be refused; on the event loop that stalled /health and every stream for
that long. Three things keep it off:

- ``off_loop`` runs rendering and tokenizing on a worker thread, at most
  ``PROMPT_WORKERS`` at a time (the rest wait their turn; what they hold is their parsed
  body, which --max-request-body-bytes and --max-queued-requests bound).
- A prompt of more characters than ``max_model_len`` tokens can cover is refused before
  tokenizing, where the tokenizer's kind proves a bound (``char_bound``: a byte-level
  BPE, whose tokens each cover at most so many bytes).
- The Rust tokenizer is called through ``encode_batch_fast``, which releases the GIL
  (the thread would stall the loop otherwise) and builds no offsets (their release took
  ~80 ms of GIL for 2 MB); its length is read before its ids become a Python list.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from atom_core.engine.validation import context_error

T = TypeVar("T")

# How many prompts are rendered and tokenized at a time: the Rust part runs in parallel,
# and a normal prompt takes a millisecond, so a few workers keep up with any arrival rate.
PROMPT_WORKERS = min(4, os.cpu_count() or 1)
_workers = anyio.CapacityLimiter(PROMPT_WORKERS)

# The most code points NFC folds into one character: an output character comes from at
# most as many input characters as its canonical decomposition has (ᾂ: α + 3 marks).
NFC_MAX_FOLD = 4
_LEADING_SPACE = re.compile(r"\s*")
# Split behaviours that keep every character ("removed" drops its matches).
_KEEPING_SPLIT = frozenset({"isolated", "merged_with_previous", "merged_with_next", "contiguous"})


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread, at most PROMPT_WORKERS at once (first come,
    first served). Cancelling the caller waits for ``fn`` to return: the thread cannot be
    stopped, and the limit must count it until it ends."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=_workers)


def trimmed_len(text: str) -> int:
    """``len(text.strip())`` without copying a long text: only its ends are looked at."""
    lead = _LEADING_SPACE.match(text).end()
    k = 64
    while True:
        tail = text[max(lead, len(text) - k):]
        trail = len(tail) - len(tail.rstrip())
        if trail < len(tail) or lead + len(tail) == len(text):  # the run ends in the window
            return len(text) - lead - trail
        k *= 2


def byte_chars() -> dict[int, str]:
    """The character a byte-level BPE writes each byte as (GPT-2's table, which
    ``tokenizers``' ByteLevel uses): printable bytes stand for themselves, the rest are
    shifted past U+0100."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


@dataclass(frozen=True)
class CharBound:
    """What a tokenizer's kind proves about any text: at least
    ``(len(text) - fold * dropped) / (fold * longest)`` tokens, where ``longest`` is the
    most bytes one token covers, ``fold`` the most characters its normalizer folds into
    one, and ``dropped`` counts the text's ``droppable`` characters: one-byte characters
    missing from the vocabulary, which a BPE without an unknown token drops (SmolLM2's
    lacks six control characters)."""

    longest: int
    fold: int = 1
    droppable: tuple[str, ...] = ()

    def at_least(self, texts: Sequence[str], limit: int, trimmed: bool = False) -> int | None:
        """A lower bound on the tokens of a text holding all of ``texts`` (``trimmed``:
        each perhaps without its leading and trailing whitespace) when it reaches
        ``limit``, else None. The droppable characters are only counted (a scan of each
        text) when it might."""
        span = self.fold * self.longest
        chars = sum(map(trimmed_len if trimmed else len, texts))
        if -(-chars // span) < limit:
            return None
        kept = chars - self.fold * sum(t.count(c) for t in texts for c in self.droppable)
        n = -(-kept // span)
        return n if n >= limit else None


def char_bound(tokenizer: Any) -> CharBound | None:
    """The bound ``tokenizer``'s kind proves; None when it proves none (its prompts are
    then tokenized before they can be refused).

    Proven for a byte-level BPE: a model token covers as many bytes as its string has
    characters, an added token its content's bytes, and no added token swallows the
    whitespace around it. Every character but the droppable ones keeps at least one byte
    in the vocabulary (every UTF-8 continuation byte must be there), so at least one byte
    per character is covered by some token. A normalizer may only be NFC (it folds at
    most NFC_MAX_FOLD characters into one); pre-tokenizers may only split, never drop.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    if model.get("type") != "BPE" or model.get("fuse_unk") or not isinstance(pre, dict):
        return None  # fuse_unk: a run of unknown bytes would be one token
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(s.get("type") == "ByteLevel" for s in steps):
        return None
    for s in steps:
        kind = s.get("type")
        if kind == "Split" and str(s.get("behavior", "")).lower() not in _KEEPING_SPLIT:
            return None
        if kind not in ("ByteLevel", "Split", "Digits"):
            return None
    vocab: dict[str, int] = model.get("vocab") or {}
    chars = byte_chars()
    if any(chars[b] not in vocab for b in range(0x80, 0xC0)):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    normalizer = spec.get("normalizer")
    if normalizer is None:
        fold = 1
    elif normalizer.get("type") == "NFC":
        fold = NFC_MAX_FOLD
    else:
        return None
    longest = max([len(t) for t in vocab] + [len(a.get("content", "").encode()) for a in added])
    # Without an unknown token, a byte missing from the vocabulary is dropped.
    missing = [chr(b) for b in range(0x80) if chars[b] not in vocab]
    droppable = tuple(missing) if model.get("unk_token") is None else ()
    return CharBound(longest, fold, droppable)


class PromptTokenizer:
    """``encode(text, ...)`` for a handler's worker thread: the prompt's ids, or the
    context-length 400 as soon as it is certain (before tokenizing when the character
    count already proves it). The request's check is ``check_request``, on the ids; this
    refuses the same prompts early, so that one that cannot be served costs little."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bound = char_bound(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # transformers' encode is this call when the backend has no truncation or padding
        # set and splits special tokens as transformers would; otherwise it is called.
        direct = (
            backend is not None and hasattr(backend, "encode_batch_fast")
            and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens
            == bool(getattr(tokenizer, "split_special_tokens", False))
        )
        self._backend = backend if direct else None

    def refuse_beyond(self, texts: Sequence[str], max_model_len: int, param: str,
                      trimmed: bool = False) -> None:
        """InvalidRequestError when a prompt holding all of ``texts`` (``trimmed``: perhaps
        stripped) certainly fills ``max_model_len``, proven from their characters alone."""
        if self.bound is None:
            return
        at_least = self.bound.at_least(texts, max_model_len, trimmed)
        if at_least is not None:
            raise context_error(max_model_len, at_least, param, at_least=True)

    def encode(
        self, text: str, add_special_tokens: bool, max_model_len: int, param: str
    ) -> list[int]:
        """The ids of ``text``; InvalidRequestError when they would fill ``max_model_len``."""
        self.refuse_beyond([text], max_model_len, param)
        if self._backend is None:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            if len(ids) >= max_model_len:
                raise context_error(max_model_len, len(ids), param)
            return ids
        [encoding] = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        if len(encoding) >= max_model_len:  # refused before its ids become a Python list
            raise context_error(max_model_len, len(encoding), param)
        return encoding.ids
