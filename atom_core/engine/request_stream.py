"""Per-request delivery from the engine to a response coroutine.

The engine sends one message per step for all streams; the dispatcher turns each
request's part into a RequestDelta and puts it in that request's StreamOutputCollector.
A collector holds at most one delta: anything arriving behind an unread one merges into
it, so a consumer that keeps up sees one delta per step and one that falls behind gets
the backlog in one piece, never a growing queue.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass, field

from atom_core.engine.sequence import Logprob, RequestTimings

# time.monotonic() when the HTTP request served in this context arrived, before its body
# was read: where the frontend's share of a request starts (set by the server's outermost
# middleware, read by EngineClient.generate).
received_at: ContextVar[float | None] = ContextVar("atom_request_received_at", default=None)


@dataclass(frozen=True)
class RequestPhases:
    """Where one finished request's time went, in seconds. Up to its first token: the
    frontend (HTTP body, chat template, tokenization, checks), the engine's queue, the
    prefill (scheduled to first token on the engine's host) and the first token's delivery
    (the link back, detokenization, the event loop, up to the response handler). After it:
    the first decode (first to second token) and all of decode (first to last token)."""

    frontend: float | None
    queue: float | None
    prefill: float | None
    first_token_delivery: float | None
    first_decode: float | None
    decode: float | None

    @classmethod
    def of(
        cls, received: float | None, sent: float, handed: float, t: RequestTimings
    ) -> RequestPhases:
        """``received``: the HTTP request's arrival (None outside HTTP); ``sent``: queued to
        the engine; ``handed``: the first delta handed to the response; ``t``: the engine's
        timestamps. All ``time.monotonic()``, one clock for every process of the host."""

        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else max(b - a, 0.0)

        return cls(
            span(received, sent), span(t.arrival, t.scheduled), span(t.scheduled, t.first_token),
            span(t.first_token, handed), span(t.first_token, t.second_token),
            span(t.first_token, t.finished),
        )


@dataclass
class RequestDelta:
    """What one request gained since the last delta its consumer read."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None  # the engine could not serve this request (e.g. it died)
    merged: int = 1  # how many engine deltas this one carries
    phases: RequestPhases | None = None  # on the finished delta, when the engine timed it

    def merge(self, newer: RequestDelta) -> None:
        self.text += newer.text
        self.token_ids += newer.token_ids
        self.logprobs += newer.logprobs
        self.finished = newer.finished
        self.finish_reason = newer.finish_reason
        self.stop_reason = newer.stop_reason
        self.num_output_tokens = newer.num_output_tokens
        if newer.prompt_logprobs is not None:
            self.prompt_logprobs = newer.prompt_logprobs
        self.ttft_s = self.ttft_s if self.ttft_s is not None else newer.ttft_s
        self.latency_s = newer.latency_s
        self.error = self.error or newer.error
        self.merged += newer.merged
        self.phases = newer.phases


class StreamOutputCollector:
    """Holds at most one RequestDelta; put() never blocks, get() waits for one."""

    def __init__(self) -> None:
        self._pending: RequestDelta | None = None
        self._ready = asyncio.Event()

    def put(self, delta: RequestDelta) -> None:
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        self._ready.set()

    async def get(self) -> RequestDelta:
        while self._pending is None:
            self._ready.clear()
            await self._ready.wait()
        delta, self._pending = self._pending, None
        self._ready.clear()
        return delta

    def get_nowait(self) -> RequestDelta | None:
        delta, self._pending = self._pending, None
        return delta
