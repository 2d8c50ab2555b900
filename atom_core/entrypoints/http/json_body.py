"""Request bodies read and parsed without long stalls of the event loop.

FastAPI joins a body's chunks and parses it with ``json.loads`` on the event loop, in
one step: a 30 MB prompt held the loop (and so /health and every stream) for 35-120 ms
of parsing plus a 30 MB copy on a 2-core VM. Here:

- the chunks are joined on a worker thread when the body is large: ``bytes.join``
  lets go of the GIL while it copies (a body delivered in one chunk is not copied);
- the loop gets a turn between reading a large body and parsing it;
- ``pydantic_core.from_json`` parses (~5 ms warm for 30 MB against json.loads' 35). It
  holds the GIL, so a thread would not help. What it refuses (a UTF-8 BOM, a lone
  surrogate escape, UTF-16, malformed JSON) goes to ``json.loads``, so every body gets
  the standard library's answer, its value or its error, as before.

``app.router.route_class = JSONBodyRoute`` (before the routes are added) gives every
route's handler a ``JSONBodyRequest``; the request models, their validation and the
OpenAPI document stay FastAPI's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from contextlib import aclosing
from typing import Any

import anyio.lowlevel
import anyio.to_thread
import pydantic_core
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

# Below this a join on the loop costs less than the hand-over to a thread.
THREAD_JOIN_BYTES = 1 << 20


def loads(body: bytes) -> Any:
    """``json.loads(body)``'s value or error, parsed by pydantic when it can."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return json.loads(body)


class JSONBodyRequest(Request):
    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            async with aclosing(self.stream()) as stream:
                chunks = [chunk async for chunk in stream if chunk]
            size = sum(map(len, chunks))
            if size >= THREAD_JOIN_BYTES and len(chunks) > 1:
                self._body = await anyio.to_thread.run_sync(b"".join, chunks)
            else:
                self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                if size >= THREAD_JOIN_BYTES:
                    # Whoever buffered it copied it on this turn: parsing waits for the next.
                    await anyio.lowlevel.checkpoint()
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """FastAPI's route with its request read as a JSONBodyRequest (FastAPI's documented
    way to customise the Request class of a route)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return handle
