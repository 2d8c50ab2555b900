"""The operator's request limits on a real server started with small ones: body size (413),
prompts and sequences per request (400), the per-request timeout (504, or an error event
on a stream; the generation aborted) and the queue of requests without a first token
(429, counted right through disconnects and errors).

The engine runs one sequence at a time (--max-num-seqs 1), so a long request keeps the
ones behind it waiting for their first token, and n=8 x 480 tokens (3,840 one-sequence
steps, over 5 s on a 2-core VM) takes far longer than the timeout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from atom_core.entrypoints.server_process import ServerProcess
from tests.reliability.engine_gauges import GENERATED, metric, wait_until_idle, wait_until_running

pytestmark = pytest.mark.slow

BODY_LIMIT = 65536
TIMEOUT_S = 2.0
MAX_QUEUED = 2
MAX_TOKENS = 480  # the prompts are shorter than 32 tokens
LIMIT_FLAGS = (
    "--max-model-len", "512", "--served-model-name", "tiny", "--max-num-seqs", "1",
    "--max-request-body-bytes", str(BODY_LIMIT), "--max-prompts-per-request", "4",
    "--max-sequences-per-request", "8", "--request-timeout", str(TIMEOUT_S),
    "--max-queued-requests", str(MAX_QUEUED),
)
LONG = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 8}  # thousands of one-sequence steps
CHAT = {"messages": [{"role": "user", "content": "hello"}]}
MESSAGES = {"model": "tiny", "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def limited(start_server) -> Iterator[ServerProcess]:
    srv = start_server(*LIMIT_FLAGS)
    yield srv
    srv.stop()


@pytest.fixture
def http(limited) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited.base_url, timeout=60) as client:
        yield client


def openai_error(r: httpx.Response, status: int, error_type: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == error_type and error["message"]
    return error


def anthropic_error(r: httpx.Response, status: int, error_type: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type
    return body["error"]


# --------------------------------------------------------------------------- body size


def test_declared_body_over_the_limit_is_413_before_it_is_read(http):
    big = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    err = openai_error(http.post("/v1/completions", content=big), 413, "invalid_request_error")
    assert "--max-request-body-bytes" in err["message"]
    anthropic_error(http.post("/v1/messages", content=big), 413, "request_too_large")
    assert http.get("/health").status_code == 200  # the connection and the server go on


def test_chunked_body_over_the_limit_is_413(http):
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = http.post("/v1/completions", content=chunks())  # no Content-Length: counted
    openai_error(r, 413, "invalid_request_error")


def test_body_under_the_limit_reaches_the_handler(http):
    body = {"prompt": "x" * (BODY_LIMIT - 100), "max_tokens": 1}
    err = openai_error(http.post("/v1/completions", json=body), 400, "invalid_request_error")
    assert "maximum context length" in err["message"]  # read, tokenized, refused on length
    assert err["code"] == "context_length_exceeded"


# ------------------------------------------------------------------ prompts and sequences


def test_prompts_and_sequences_per_request(http):
    five = {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1}
    err = openai_error(http.post("/v1/completions", json=five), 400, "invalid_request_error")
    assert err["param"] == "prompt" and "--max-prompts-per-request" in err["message"]
    ten = {"prompt": ["a", "b"], "n": 5, "max_tokens": 1}
    err = openai_error(http.post("/v1/completions", json=ten), 400, "invalid_request_error")
    assert err["param"] == "n" and "--max-sequences-per-request" in err["message"]
    err = openai_error(http.post("/v1/chat/completions", json={**CHAT, "n": 9, "max_tokens": 1}),
                       400, "invalid_request_error")
    assert err["param"] == "n"
    eight = {"prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 1}
    r = http.post("/v1/completions", json=eight)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


# ----------------------------------------------------------------------------- timeout


def timed_out_and_aborted(srv: ServerProcess, started: float, generated_before: float) -> None:
    elapsed = time.monotonic() - started
    assert TIMEOUT_S - 0.1 < elapsed < TIMEOUT_S + 2, elapsed
    assert wait_until_idle(srv.base_url, timeout=1.0) <= 1.0  # the generation was aborted
    assert metric(srv.base_url, GENERATED) - generated_before < 8 * MAX_TOKENS


def test_timeout_non_streamed_is_504_and_aborts(limited, http):
    wait_until_idle(limited.base_url, timeout=10)
    before, start = metric(limited.base_url, GENERATED), time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "slow", **LONG})
    err = openai_error(r, 504, "server_error")
    assert "--request-timeout" in err["message"]
    timed_out_and_aborted(limited, start, before)


def test_timeout_stream_ends_with_an_error_frame_and_aborts(limited, http):
    wait_until_idle(limited.base_url, timeout=10)
    before, start = metric(limited.base_url, GENERATED), time.monotonic()
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, **LONG, "stream": True}) as r:
        assert r.status_code == 200
        frames = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(frames) > 3  # tokens went out before the timeout
    assert frames[-1] == "data: [DONE]"
    assert frames[-2].startswith('data: {"error":') and "--request-timeout" in frames[-2]
    timed_out_and_aborted(limited, start, before)


def test_timeout_anthropic_stream_ends_with_an_error_event(limited, http):
    wait_until_idle(limited.base_url, timeout=10)
    streams = Streams(limited.base_url)
    try:
        ahead = streams.start()  # the message waits behind it until that one times out
        assert ahead.status_code == 200
        start = time.monotonic()
        # Greedy, this prompt runs to max_tokens (no EOS): it cannot end before its timeout.
        body = {**MESSAGES, "temperature": 0.0, "stream": True}
        with http.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        elapsed = time.monotonic() - start
    finally:
        streams.close_all()
    assert lines[-2] == "event: error", lines
    assert '"type":"error"' in lines[-1] and "--request-timeout" in lines[-1]
    assert TIMEOUT_S - 0.1 < elapsed < TIMEOUT_S + 2
    assert wait_until_idle(limited.base_url, timeout=1.0) <= 1.0


# ------------------------------------------------------------------------------- queue


class Streams:
    """Streamed requests held open; each is admitted once its headers are in."""

    def __init__(self, base_url: str) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=30)
        self.open: list[httpx.Response] = []
        self.lines: list[Iterator[str]] = []  # held: a dropped one closes its connection

    def start(self, path: str = "/v1/completions", body: dict | None = None) -> httpx.Response:
        body = body or {"prompt": "queue", **LONG, "stream": True}
        r = self.client.send(self.client.build_request("POST", path, json=body), stream=True)
        if r.status_code == 200:
            self.open.append(r)
        else:
            r.read()
        return r

    def first_line(self, r: httpx.Response) -> str:
        self.lines.append(r.iter_lines())
        return next(self.lines[-1])

    def close(self, r: httpx.Response) -> None:
        r.close()
        self.open.remove(r)

    def close_all(self) -> None:
        for r in self.open:
            r.close()
        self.client.close()


def fill_queue(streams: Streams, base_url: str) -> list[httpx.Response]:
    """One request generating (not queued) and MAX_QUEUED waiting for the engine."""
    running = streams.start()
    assert running.status_code == 200
    streams.first_line(running)  # its first token: it has left the queue
    wait_until_running(base_url)
    waiting = [streams.start() for _ in range(MAX_QUEUED)]
    assert [r.status_code for r in waiting] == [200] * MAX_QUEUED
    return [running, *waiting]


def test_queue_full_is_429_and_counts_right(limited):
    base = limited.base_url
    wait_until_idle(base, timeout=10)
    streams = Streams(base)
    try:
        running, first, second = fill_queue(streams, base)
        full = streams.start()
        err = openai_error(full, 429, "rate_limit_error")
        assert "--max-queued-requests" in err["message"] and full.headers["retry-after"]
        anthropic_error(streams.start("/v1/messages", MESSAGES), 429, "rate_limit_error")
        assert httpx.get(f"{base}/v1/models").status_code == 200  # only generation is queued

        streams.close(first)  # a queued request that leaves gives its place back
        deadline = time.monotonic() + 1.0
        while (again := streams.start()).status_code == 429:
            assert time.monotonic() < deadline, "a disconnected request kept its place"
            time.sleep(0.05)
        assert again.status_code == 200
    finally:
        streams.close_all()
    wait_until_idle(base, timeout=10)

    # Requests that end in an error after admission give their place back too.
    for _ in range(MAX_QUEUED + 1):
        r = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400

    streams = Streams(base)
    try:  # the queue holds exactly MAX_QUEUED again: nothing leaked
        fill_queue(streams, base)
        assert streams.start().status_code == 429
    finally:
        streams.close_all()
    wait_until_idle(base, timeout=10)
