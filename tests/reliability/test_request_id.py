"""X-Request-Id: echoed when sent, made up when not (or when not a log-safe token), on
every kind of response; the frontend's log lines name it; two clients sending the same
one still get separate engine requests."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import httpx
import pytest

from atom_core.entrypoints.http.app import AtomApp
from atom_core.entrypoints.http.errors import install_error_handlers
from tests.reliability.conftest import AUTH
from tests.reliability.engine_gauges import send_raw, wait_until_idle, wait_until_running

pytestmark = pytest.mark.slow

GENERATED = re.compile(r"[0-9a-f]{32}")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def fresh_id() -> str:
    return f"client-{uuid.uuid4()}"


def test_echoed_on_every_kind_of_response(server, http):
    cases = [
        ("GET", "/v1/models", None, AUTH, 200),
        ("GET", "/health", None, {}, 200),
        ("GET", "/v1/models", None, {}, 401),  # refused by the auth layer
        ("POST", "/v1/chat/completions", {"messages": []}, AUTH, 400),
        ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}, AUTH, 404),
        ("GET", "/v1/nope", None, AUTH, 404),
        ("POST", "/v1/chat/completions", CHAT, AUTH, 200),
    ]
    for method, path, body, headers, status in cases:
        rid = fresh_id()
        r = httpx.request(method, f"{server.base_url}{path}", json=body,
                          headers={**headers, "X-Request-Id": rid}, timeout=30)
        assert r.status_code == status, (path, r.text)
        assert r.headers["x-request-id"] == rid, path


def test_echoed_on_a_stream(http):
    rid = fresh_id()
    body = {**CHAT, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        assert list(r.iter_lines())[-2] == "data: [DONE]"


def test_generated_when_absent_or_unusable(http):
    ids = [http.get("/v1/models").headers["x-request-id"] for _ in range(3)]
    assert all(GENERATED.fullmatch(i) for i in ids) and len(set(ids)) == 3
    for unusable in ("has spaces in it", "x" * 129, ""):
        rid = http.get("/v1/models", headers={"X-Request-Id": unusable}).headers["x-request-id"]
        assert GENERATED.fullmatch(rid), unusable


def test_same_id_from_two_clients_makes_two_engine_requests(server):
    rid = fresh_id()
    body = {"prompt": "same id", "max_tokens": 16, "ignore_eos": True}

    async def both() -> list[httpx.Response]:
        headers = {**AUTH, "X-Request-Id": rid}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers,
                                     timeout=60) as client:
            posts = (client.post("/v1/completions", json=body) for _ in range(2))
            return await asyncio.gather(*posts)

    responses = asyncio.run(both())
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert all(r.headers["x-request-id"] == rid for r in responses)
    assert responses[0].json()["id"] != responses[1].json()["id"]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in responses)


def test_log_lines_name_the_request(server):
    rid = fresh_id()
    wait_until_idle(server.base_url, timeout=20)
    body = {"prompt": "log me", "max_tokens": 200, "ignore_eos": True}
    sock = send_raw(server.base_url, "/v1/completions", body, {**AUTH, "X-Request-Id": rid})
    try:
        wait_until_running(server.base_url)
    finally:
        sock.close()  # logged: the client left, the generation is aborted
    deadline = time.monotonic() + 5
    while f"[{rid}] " not in server.log_path.read_text():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    [line] = [line for line in server.log_path.read_text().splitlines() if rid in line]
    assert "client disconnected" in line


def test_a_500_carries_it_too():
    """The id is added outside FastAPI's error middleware, which answers a 500 itself."""
    app = AtomApp()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/boom", headers={"X-Request-Id": "bug-report-1"})

    r = asyncio.run(get())
    assert r.status_code == 500 and r.headers["x-request-id"] == "bug-report-1"
