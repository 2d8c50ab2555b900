"""The engine's gauges read off a server's /metrics (open without the API key), and a
client that sends a request and hangs up on it: what the limit, disconnect and request-id
tests check the engine with."""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

import httpx

RUNNING = "atom:num_requests_running"
WAITING = "atom:num_requests_waiting"
KV_USAGE = "atom:kv_cache_usage_perc"
GENERATED = "atom:generation_tokens_total"


def metrics(base_url: str, *names: str) -> dict[str, float]:
    """The values of ``names`` in one scrape."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for name in names:
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        values[name] = float(m.group(1))
    return values


def metric(base_url: str, name: str) -> float:
    return metrics(base_url, name)[name]


def gauges(base_url: str) -> dict[str, float]:
    return metrics(base_url, RUNNING, WAITING, KV_USAGE)


def wait_until_idle(base_url: str, timeout: float) -> float:
    """Seconds until no request runs or waits and no KV block is in use; fails past
    ``timeout`` with the gauges it last read. The engine reports them with every step."""
    start = time.monotonic()
    while True:
        now = gauges(base_url)
        if not any(now.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"engine not idle {timeout} s on: {now}")
        time.sleep(0.02)


def wait_until_running(base_url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(base_url, RUNNING) < 1:
        assert time.monotonic() < deadline, f"no request running after {timeout} s"
        time.sleep(0.02)


def send_raw(
    base_url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> socket.socket:
    """POST ``body`` on a plain socket and return it unread: the caller hangs up by closing it."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = {"Host": host, "Content-Type": "application/json", "Content-Length": str(len(payload)),
            **headers}
    request = (
        f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    )
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(request.encode() + payload)
    return sock
