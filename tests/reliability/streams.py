"""A streamed completion read on a thread of its own, every SSE frame time-stamped, for the
tests that do something to the server while a stream runs."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx


class StreamReader(threading.Thread):
    """POSTs ``body`` (a streamed request) and reads it to its end. ``frames`` holds
    (monotonic time, payload): the parsed JSON of each ``data:`` frame, or "[DONE]";
    ``failure`` the exception that ended the read early (the connection closed), if any."""

    def __init__(
        self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.frames: list[tuple[float, Any]] = []
        self.status: int | None = None
        self.failure: Exception | None = None
        self.first_frame = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url, json=self.body, headers=self.headers, timeout=120
            ) as r:
                self.status = r.status_code
                # Split on b"\n" only: httpx's iter_lines also splits on U+2028 and the like,
                # which a random model's text holds.
                pending = b""
                for chunk in r.iter_bytes():
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        self._frame(line.decode())
        except httpx.HTTPError as exc:
            self.failure = exc
        finally:
            self.first_frame.set()  # a stream that failed before its first frame wakes waiters too

    def _frame(self, line: str) -> None:
        if line.startswith("data: "):
            data = line[6:]
            self.frames.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
            self.first_frame.set()

    def started(self, timeout: float = 60) -> StreamReader:
        """Start it and wait for its first frame."""
        self.start()
        assert self.first_frame.wait(timeout), "no first frame"
        assert self.frames, f"the stream ended before its first frame: {self.status} {self.failure}"
        return self

    @property
    def done(self) -> bool:
        return bool(self.frames) and self.frames[-1][1] == "[DONE]"

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [p["error"] for _, p in self.frames if isinstance(p, dict) and "error" in p]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for _, p in self.frames if isinstance(p, dict)
                for c in p.get("choices", ()) if c.get("finish_reason")]

    def text(self) -> str:
        return "".join(c.get("text", "") for _, p in self.frames if isinstance(p, dict)
                       for c in p.get("choices", ()))
