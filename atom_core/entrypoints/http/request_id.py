"""X-Request-Id: every response carries one, and the frontend's log lines name it.

A client's own id (visible ASCII, at most 128 characters) is echoed; without one, or with
one outside that form, the server makes one up and sends that. It names the HTTP request
only: the engine's request ids stay the handlers' random ones, so two clients sending the
same X-Request-Id never collide in the engine.

While a request is served, ``RequestIdLogFilter`` prefixes every log record with
``[<id>]``: records logged by the handlers, by tasks they start (which copy the context)
and by the error handlers.

The same middleware stamps when the request arrived (``request_stream.received_at``): where
the frontend's share of the request's time split (``RequestPhases``) starts.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom_core.engine.request_stream import received_at as _received_at

HEADER = b"x-request-id"
_CLIENT_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # one log-safe token; no spaces

_request_id: ContextVar[str | None] = ContextVar("atom_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the HTTP request being served in this context, if any."""
    return _request_id.get()


def _request_id_of(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == HEADER and _CLIENT_ID.fullmatch(value):
            return value.decode("ascii")
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware, which wraps streamed bodies): the outermost layer,
    so error responses, streams and the 500 handler's log line all carry the id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id_of(scope)
        header = (HEADER, request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        token = _request_id.set(request_id)
        received = _received_at.set(time.monotonic())
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _received_at.reset(received)
            _request_id.reset(token)


class RequestIdLogFilter(logging.Filter):
    """Prefixes a record logged while a request is served with ``[<request id>]`` (and
    sets ``record.request_id`` for formats that name it). Installed on handlers, so it
    sees records from every logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _request_id.get()
        if request_id is None or hasattr(record, "request_id"):
            return True  # outside a request, or prefixed by another handler's filter
        record.request_id = request_id
        try:
            message = record.getMessage()
        except Exception:  # a bad format: left for the formatter to report
            return True
        # Formatted here so that the id can hold '%' without breaking msg % args.
        record.msg, record.args = f"[{request_id}] {message}", None
        return True


def install_log_filter() -> Callable[[], None]:
    """Put the filter on the root logger's handlers and uvicorn's (its error logger does
    not propagate); returns the function that takes it off again. Called once uvicorn
    has configured logging, which replaces its own handlers."""
    log_filter = RequestIdLogFilter()
    handlers = {
        *logging.getLogger().handlers,
        *logging.getLogger("uvicorn").handlers,
        *logging.getLogger("uvicorn.error").handlers,
    }
    for handler in handlers:
        handler.addFilter(log_filter)

    def remove() -> None:
        for handler in handlers:
            handler.removeFilter(log_filter)

    return remove
