"""--timeout-header-read (3 s on the shared server): a connection that sends its
request headers slowly (slowloris) or sends nothing is closed after that long, with a 408
if it had sent part of a request; requests sent at a normal pace are unaffected."""

from __future__ import annotations

import socket
import time

import pytest

from tests.reliability.conftest import SERVER_FLAGS

pytestmark = pytest.mark.slow

TIMEOUT_S = float(SERVER_FLAGS[SERVER_FLAGS.index("--timeout-header-read") + 1])
SLACK_S = 2.0


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S + SLACK_S + 5)


def get_health(sock: socket.socket) -> bytes:
    """One GET /health on ``sock``, its whole response read (status line to body's end)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return head


def trickle_until_closed(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Send one header byte a second until the server closes; (seconds, what it sent)."""
    start = time.monotonic()
    sock.settimeout(1.0)
    while time.monotonic() - start < limit_s:
        try:
            sock.sendall(b"x")
        except OSError:
            pass  # closed: what it said, if anything, is still to be read
        try:
            reply = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            reply = b""
        return time.monotonic() - start, reply
    return time.monotonic() - start, b""


def test_slowloris_headers_are_cut_off(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        took, reply = trickle_until_closed(sock, TIMEOUT_S + SLACK_S + 5)
    assert TIMEOUT_S - 1.0 <= took <= TIMEOUT_S + SLACK_S, took
    assert reply.startswith(b"HTTP/1.1 408 "), reply


def test_a_silent_connection_is_closed(server):
    with connect(server) as sock:
        start = time.monotonic()
        assert sock.recv(4096) == b""  # closed, with nothing said: nothing was asked
        took = time.monotonic() - start
    assert TIMEOUT_S - 0.5 <= took <= TIMEOUT_S + SLACK_S, took


def test_the_next_request_on_a_kept_alive_connection_has_the_deadline_too(server):
    with connect(server) as sock:
        assert get_health(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        took, reply = trickle_until_closed(sock, TIMEOUT_S + SLACK_S + 5)
    assert TIMEOUT_S - 1.0 <= took <= TIMEOUT_S + SLACK_S, took
    assert reply.startswith(b"HTTP/1.1 408 "), reply


def test_requests_at_a_normal_pace_are_served(server):
    with connect(server) as sock:
        for _ in range(3):  # keep-alive: each request well within the deadline, the sum past it
            time.sleep(TIMEOUT_S / 2)
            assert get_health(sock).startswith(b"HTTP/1.1 200 ")
