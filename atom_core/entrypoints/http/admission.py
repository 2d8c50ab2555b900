"""What a generation request (POST /v1/chat/completions, /v1/completions, /v1/messages)
is held to between its body being read and its last byte: the operator's limits, and
the client staying connected.

- ``--max-queued-requests``: a request is *queued* from admission until its first output
  token reaches the frontend (tokenizing, waiting in the engine, prefilling), or until it
  ends without one (an error, a disconnect, a timeout). One over the limit is refused
  with 429 rate_limit_error and Retry-After. A request with several sequences (n,
  a list prompt) holds one place.
- ``--request-timeout``: past it the handler is cancelled, which aborts its generation.
  A client still waiting for the headers gets 504; a stream, whose 200 already went out,
  gets an error event (504) and its end.
- A client that goes away cancels the handler too, streamed or not: cancelling it closes
  ``stream_deltas``, whose cleanup aborts the engine requests and frees their KV blocks
  (as vLLM's ``with_cancellation`` does for its non-streamed routes).
- ``--max-prompts-per-request`` and ``--max-sequences-per-request`` (n x prompts): 400s,
  checked before tokenizing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom_core.engine.request_stream import RequestDelta
from atom_core.entrypoints.http.anthropic.protocol import error_out
from atom_core.entrypoints.http.errors import exception_body
from atom_core.entrypoints.http.guards import error_for
from atom_core.entrypoints.http.sse import DONE_FRAME, data_frame, event_frame
from atom_core.errors import InvalidRequestError, QueueFullError, RequestTimeoutError
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})


@dataclass(frozen=True)
class RequestLimits:
    """The per-request limits of the server's flags (server_args)."""

    max_prompts: int
    max_sequences: int
    timeout_s: float | None = None
    max_queued: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(args.max_prompts_per_request, args.max_sequences_per_request,
                   args.request_timeout, args.max_queued_requests)

    def check(self, prompts: int, n: int) -> None:
        """400 for a request of ``prompts`` prompts with ``n`` choices each over a limit."""
        if prompts > self.max_prompts:
            raise InvalidRequestError(
                f"{prompts} prompts in one request; this server takes at most "
                f"{self.max_prompts} (--max-prompts-per-request)", param="prompt",
            )
        if prompts * n > self.max_sequences:
            raise InvalidRequestError(
                f"n={n} for {prompts} prompt(s) asks for {prompts * n} sequences; this server "
                f"generates at most {self.max_sequences} per request (--max-sequences-per-request)",
                param="n",
            )


class AdmissionQueue:
    """The count of queued requests (see the module docstring) against the limit. Only
    the event loop's thread touches it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queued = 0

    def admit(self) -> Ticket | None:
        """A place in the queue, or None when it is full."""
        if self.queued >= self.limit:
            return None
        self.queued += 1
        return Ticket(self)


class Ticket:
    """One request's place in the AdmissionQueue; ``release`` gives it back, once."""

    def __init__(self, queue: AdmissionQueue) -> None:
        self._queue: AdmissionQueue | None = queue

    def release(self) -> None:
        if self._queue is not None:
            self._queue.queued -= 1
            self._queue = None


_ticket: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("atom_ticket", default=None)


class FirstTokenWatch:
    """The engine client the handlers see when the queue is bounded: ``generate`` gives
    the request's place back with its first output. Everything else is the client's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestDelta]:
        ticket = _ticket.get()  # the handler's context: stream_deltas' tasks copy it
        # aclosing: closing this generator must close the client's, which aborts.
        async with aclosing(self._engine.generate(prompt_token_ids, params, request_id)) as deltas:
            async for delta in deltas:
                if ticket is not None:
                    ticket.release()
                yield delta


class GenerationGuard:
    """Pure ASGI middleware around the generation routes; every other request passes
    through untouched. It runs inside BodySizeLimitMiddleware, so the body is in memory
    and the first ``receive`` returns it at once."""

    def __init__(self, app: ASGIApp, limits: RequestLimits, queue: AdmissionQueue | None) -> None:
        self.app = app
        self.timeout_s = limits.timeout_s
        self.queue = queue

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["method"] == "POST"
        if not guarded or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        ticket = None
        if self.queue is not None:
            ticket = self.queue.admit()
            if ticket is None:
                err = QueueFullError(
                    f"{self.queue.limit} requests are already waiting for their first token "
                    "(--max-queued-requests); retry later"
                )
                await error_for(scope, err, {"Retry-After": "1"})(scope, receive, send)
                return
        try:
            await _GuardedRequest(self.app, scope, receive, send, ticket).run(self.timeout_s)
        finally:
            if ticket is not None:
                ticket.release()


class _GuardedRequest:
    """The app run as a task of its own, beside a task that is the only reader of the
    client's ``receive``: it hands the body to the app and, when the client disconnects
    before the response is complete, cancels the app."""

    def __init__(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                 ticket: Ticket | None) -> None:
        self.app, self.scope, self.receive, self.send = app, scope, receive, send
        self.ticket = ticket
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.started = self.complete = self.event_stream = False
        self.app_task: asyncio.Task | None = None

    async def run(self, timeout_s: float | None) -> None:
        context = contextvars.copy_context()
        context.run(_ticket.set, self.ticket)
        # Created in ``context``: the handler and every task it starts see the ticket.
        app = self.app(self.scope, self._app_receive, self._app_send)
        app_task = context.run(asyncio.create_task, app)
        self.app_task = app_task
        reader = asyncio.create_task(self._read_client())
        try:
            done, _ = await asyncio.wait({app_task}, timeout=timeout_s)
            if not done:
                await _cancel(app_task)
                if not self.complete:  # else only the app's last steps were cut
                    logger.warning("request timed out after %g s (--request-timeout); "
                                   "generation aborted", timeout_s)
                    await self._send_timeout(timeout_s)
            elif not app_task.cancelled():  # cancelled: the client left, nobody to answer
                app_task.result()  # the app's own exception goes on to the error middleware
        finally:
            reader.cancel()
            await _cancel(app_task)  # this task was cancelled itself (the server stopping)

    async def _app_receive(self) -> Message:
        message = await self.inbox.get()
        if message["type"] == "http.disconnect":
            self.inbox.put_nowait(message)  # every later call answers the same
        return message

    async def _app_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", ()))
            self.event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True  # before the send: from here a disconnect is the normal end
        await self.send(message)

    async def _read_client(self) -> None:
        while True:
            message = await self.receive()
            self.inbox.put_nowait(message)
            if message["type"] == "http.disconnect":
                break
        if not self.complete and self.app_task is not None and not self.app_task.done():
            logger.info("client disconnected before the response was complete; generation aborted")
            self.app_task.cancel()

    async def _send_timeout(self, timeout_s: float | None) -> None:
        err = RequestTimeoutError(
            f"the request did not finish within {timeout_s:g} s (--request-timeout)"
        )
        if not self.started:
            await error_for(self.scope, err)(self.scope, self._app_receive, self.send)
            return
        body = b""
        if self.event_stream:  # the same last words as a stream that fails on its own
            status, info = exception_body(err)
            if self.scope["path"].startswith("/v1/messages"):
                body = event_frame("error", error_out(info.error.message, status))
            else:
                body = data_frame(info) + DONE_FRAME
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


async def _cancel(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait for its cleanup (the engine aborts) to finish."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
