"""Server-sent-event framing and JSON responses, through one shared msgspec encoder.

Every token a streaming client receives costs one encode here, so it is msgspec's
(several times cheaper per frame than json.dumps) and the encoder is built once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.responses import Response, StreamingResponse

_encoder = msgspec.json.Encoder()

DONE_FRAME = b"data: [DONE]\n\n"


def encode_json(obj: Any) -> bytes:
    """``obj`` (a Struct, dict, list, ...) as JSON; NaN and infinities become null."""
    return _encoder.encode(obj)


def data_frame(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def done_frame() -> bytes:
    return DONE_FRAME


def event_frame(event: str, obj: Any) -> bytes:
    """A named event (Anthropic's /v1/messages streams these)."""
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")


def sse_response(frames: AsyncIterator[bytes]) -> StreamingResponse:
    # no-cache and X-Accel-Buffering: a proxy that buffers would hold every token back.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(frames, media_type="text/event-stream", headers=headers)
