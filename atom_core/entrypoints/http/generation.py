"""What every generation endpoint shares: the model-name check, the check of an output
constraint against the engine (``check_constraint``), ``stream_deltas`` (a response's
engine requests fanned in, and aborted together when the response is dropped),
``ChoiceTally`` (one choice's output and timings), ``usage_of``, ``TokenTexts`` and the SSE
error frame. A request's own check (prompt and sampling parameters) is the engine's
``check_request``, which each handler runs once per prompt before any engine request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from atom_core.engine.request_stream import RequestDelta
from atom_core.engine.sequence import Logprob
from atom_core.entrypoints.http.engine_api import EngineClientAPI
from atom_core.entrypoints.http.errors import exception_body
from atom_core.entrypoints.http.openai.protocol import UsageInfo
from atom_core.entrypoints.http.sse import data_frame
from atom_core.errors import AtomError, InvalidRequestError, ModelNotFoundError
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def served_names(engine: EngineClientAPI, aliases: Iterable[str] | None) -> frozenset[str]:
    """The names a request may use: the served name, plus the model path (the real
    client lists both as ``model_aliases``) or whatever the caller passes."""
    if aliases is None:
        aliases = getattr(engine, "model_aliases", ())
    return frozenset({engine.model_name, *aliases})


def check_model(requested: str | None, names: Collection[str]) -> None:
    if requested and requested not in names:
        err = ModelNotFoundError(f"The model `{requested}` does not exist.")
        err.param = "model"  # type: ignore[attr-defined]  # errors.py reads it
        raise err


def check_constraint(engine: EngineClientAPI, params: SamplingParams) -> None:
    """A 400 for an output constraint this engine cannot honour: speculative decoding
    verifies drafts without the grammar's mask. Checked here, before a stream's headers
    go out; the engine refuses it too (LLMEngine._grammar)."""
    spec = params.structured
    config = getattr(engine, "config", None)
    method = config.speculative_config.method if config is not None else None
    if spec is not None and method is not None:
        raise InvalidRequestError(
            f"{spec.param}: structured outputs are not supported with speculative decoding "
            f"(this server runs --method {method}); send the request without it or serve "
            "without speculative decoding", param=spec.param)


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of a prompt samples with seed + j, so seeded choices differ from each
    other and each is reproducible on its own (wrapped into torch.Generator's range)."""
    if params.seed is None or j == 0:
        return params
    seed = params.seed + j
    return replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)


@dataclass(frozen=True)
class EngineJob:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str


async def stream_deltas(
    engine: EngineClientAPI, jobs: list[EngineJob]
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(job index, delta) as the jobs' deltas arrive. Exceptions from the engine
    propagate. Closing this early - a disconnect, an error - closes every job's engine
    iterator, which aborts its request in the engine."""
    if len(jobs) == 1:  # the common case: no task, no hand-over
        it = _generate(engine, jobs[0])
        try:
            async for delta in it:
                yield 0, delta
        finally:
            await _close(it)
        return

    # Like StreamOutputCollector, one slot per job: a delta arriving behind an unread one
    # merges into it, so a slow reader gets the backlog in one piece.
    pending: dict[int, RequestDelta] = {}
    failures: list[BaseException] = []
    ready = asyncio.Event()
    running = len(jobs)

    async def pump(i: int, job: EngineJob) -> None:
        nonlocal running
        it = None
        try:
            it = _generate(engine, job)  # inside: a refusal here must not hang the reader
            async for delta in it:
                if i in pending:
                    pending[i].merge(delta)
                else:
                    pending[i] = delta
                ready.set()
        except Exception as exc:
            failures.append(exc)
        finally:
            running -= 1
            ready.set()
            if it is not None:
                await _close(it)

    # Plain tasks, not a task group: cleanup must run even while the reader's scope is
    # being cancelled (a disconnect), and anyio re-cancels every await inside it.
    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        while True:
            await ready.wait()
            ready.clear()
            if failures:
                raise failures[0]
            batch = sorted(pending.items())
            pending.clear()
            for item in batch:
                yield item
            if running == 0 and not pending:
                return
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


def _generate(engine: EngineClientAPI, job: EngineJob) -> AsyncIterator[RequestDelta]:
    return engine.generate(job.prompt_token_ids, job.params, job.request_id)


async def _close(it: AsyncIterator[RequestDelta]) -> None:
    # Shielded: this runs while a disconnected response is being cancelled, and the
    # abort must still reach the engine.
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


@dataclass
class ChoiceTally:
    """What one choice has produced so far. ``keep`` accumulates text and tokens (a
    full response needs them, a stream does not); ``drop_output`` discards the
    generated part (echo with max_tokens 0)."""

    keep: bool = True
    drop_output: bool = False
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    started: bool = False  # a stream frame has gone out for this choice
    text_offset: int = 0  # streaming completions: where the next token's text starts

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.ttft_s is None:
            self.ttft_s = delta.ttft_s
        if delta.latency_s is not None:
            self.latency_s = delta.latency_s
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if self.drop_output:
            return
        self.num_output_tokens = max(self.num_output_tokens, delta.num_output_tokens)
        if self.keep:
            self.parts.append(delta.text)
            self.token_ids += delta.token_ids
            self.logprobs += delta.logprobs

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def tpot_s(self) -> float:
        n, ttft, latency = self.num_output_tokens, self.ttft_s, self.latency_s
        if n < 2 or ttft is None or latency is None:
            return 0.0
        return (latency - ttft) / (n - 1)


def usage_of(prompt_tokens: int, tallies: list[ChoiceTally]) -> UsageInfo:
    """Token counts summed over choices; with several choices, ttft is the first one's,
    latency the last one's, and tpot the mean of the choices'."""
    completion = sum(t.num_output_tokens for t in tallies)
    ttfts = [t.ttft_s for t in tallies if t.ttft_s is not None]
    latencies = [t.latency_s for t in tallies if t.latency_s is not None]
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        ttft_s=min(ttfts, default=0.0),
        tpot_s=sum(t.tpot_s for t in tallies) / max(len(tallies), 1),
        latency_s=max(latencies, default=0.0),
    )


class TokenTexts:
    """Token id -> its text, cached: logprobs name every token and their top-n, mostly
    the same few thousand ids. Bounded by the vocabulary."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def error_frame(exc: Exception) -> bytes:
    """A stream's last word before [DONE] when it fails after the headers went out."""
    if not isinstance(exc, AtomError):
        logger.error("stream failed", exc_info=exc)
    return data_frame(exception_body(exc)[1])
