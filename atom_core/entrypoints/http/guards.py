"""The front door: the API key and the request body's size, checked before any handler
runs. Both are pure ASGI middleware: Starlette's BaseHTTPMiddleware (``@app.middleware``)
wraps a streamed response in a memory stream of its own, which gets in the way of
disconnect detection and of cancelling the handler.

Their refusals leave in the API's error shape: Anthropic's on /v1/messages, OpenAI's
everywhere else.
"""

from __future__ import annotations

import hmac

import anyio.to_thread
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom_core.entrypoints.http.anthropic.messages import anthropic_error_response
from atom_core.entrypoints.http.errors import error_response
from atom_core.errors import AtomError, AuthenticationError, RequestTooLargeError

# Open without the key, as in vLLM: liveness and metrics for probes and scrapers, the
# version, and the API's description (static, no model or data in it; a browser cannot
# send a bearer token to /docs, so closing it would only break the page).
OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)


def error_for(scope: Scope, exc: AtomError, headers: dict[str, str] | None = None) -> Response:
    """``exc`` as the error response of the API ``scope``'s path belongs to."""
    if scope["path"].startswith("/v1/messages"):
        response = anthropic_error_response(exc)
    else:
        response = error_response(exc)
    response.headers.update(headers or {})
    return response


class ApiKeyMiddleware:
    """Every path but OPEN_PATHS needs the key, as ``Authorization: Bearer KEY`` (OpenAI's
    SDK) or ``x-api-key: KEY`` (Anthropic's); an unknown path too, so a route added later
    is closed until it is opened here on purpose. Compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = AuthenticationError("missing or invalid API key: send 'Authorization: Bearer KEY' "
                                  "or 'x-api-key: KEY'")
        await error_for(scope, err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        ok = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                ok |= scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            elif name == b"x-api-key":
                ok |= hmac.compare_digest(value, self.key)
        return ok


class BodySizeLimitMiddleware:
    """Reads the whole body before the app runs, refusing one over ``max_bytes`` with 413:
    at once when Content-Length says so, else as soon as the bytes read pass it (a chunked
    body). The app then reads the buffered body; a handler never sees a partial one, and
    a refused request never reaches admission or the handlers."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        # bytes.join lets go of the GIL while it copies: a large body is joined off the loop.
        if size >= 1 << 20:
            body = await anyio.to_thread.run_sync(b"".join, chunks)
        else:
            body = b"".join(chunks)
        delivered = False

        async def buffered_receive() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: the disconnect, when it comes
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, buffered_receive, send)

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                return int(value)
        return 0

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = RequestTooLargeError(
            f"the request body is over {self.max_bytes} bytes (--max-request-body-bytes)"
        )
        # The connection stays open: uvicorn reads the rest of the body and drops it, where
        # closing with it unread would reset the connection under the client's reading.
        await error_for(scope, err)(scope, receive, send)
