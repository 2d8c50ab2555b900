"""Per-request delivery from the engine to a response coroutine.

The engine sends one message per step for all streams; the dispatcher turns each
request's part into a RequestDelta and puts it in that request's StreamOutputCollector.
A collector holds at most one delta: anything arriving behind an unread one merges into
it, so a consumer that keeps up sees one delta per step and one that falls behind gets
the backlog in one piece, never a growing queue.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from atom_core.engine.sequence import Logprob


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
