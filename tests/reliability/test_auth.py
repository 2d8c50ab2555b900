"""--api-key closes every route that acts; /health, /metrics, /version and the API's
description stay open (as in vLLM). The matrix runs over every route the running server
has: its OpenAPI paths plus the documentation routes the document leaves out, checked
against the app's own route table so that a new route cannot slip past it."""

from __future__ import annotations

import argparse

import httpx
import pytest

from atom_core.entrypoints.http.app import build_app
from atom_core.entrypoints.server_args import add_server_args
from atom_core.testing.tiny_models import tiny_model_dir
from tests.reliability.conftest import API_KEY, SERVER_FLAGS

pytestmark = pytest.mark.slow

OPEN = {"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect",
        "/redoc"}
NOT_IN_SCHEMA = {("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"),
                 ("GET", "/redoc")}
REFUSED = {
    "no key": {},
    "wrong bearer": {"Authorization": "Bearer not-the-key"},
    "wrong x-api-key": {"x-api-key": "not-the-key"},
    "key in another scheme": {"Authorization": f"Basic {API_KEY}"},
    "key with a suffix": {"Authorization": f"Bearer {API_KEY}x"},
    "bearer without a key": {"Authorization": "Bearer"},
}
ACCEPTED = {
    "bearer": {"Authorization": f"Bearer {API_KEY}"},
    "bearer, lower case": {"Authorization": f"bearer {API_KEY}"},
    "x-api-key": {"x-api-key": API_KEY},
}


def served_routes(base_url: str) -> set[tuple[str, str]]:
    schema = httpx.get(f"{base_url}/openapi.json", timeout=10).json()  # open: no key
    routes = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}
    return routes | NOT_IN_SCHEMA


def call(base_url: str, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    body = {"json": {}} if method == "POST" else {}
    return httpx.request(method, f"{base_url}{path}", headers=headers, timeout=30, **body)


def test_the_matrix_covers_every_route_of_the_app(server):
    args = add_server_args(argparse.ArgumentParser()).parse_args(
        [*SERVER_FLAGS, "--model", str(tiny_model_dir("llama"))]
    )
    app = build_app(args)  # not started: only its route table is read
    in_app = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}
    assert in_app == served_routes(server.base_url)
    assert {path for _, path in in_app} >= OPEN


@pytest.mark.parametrize("case", REFUSED)
def test_closed_routes_refuse_a_missing_or_wrong_key(server, case):
    for method, path in sorted(served_routes(server.base_url)):
        r = call(server.base_url, method, path, REFUSED[case])
        if path in OPEN:
            assert r.status_code == 200, (method, path, r.status_code)
            continue
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        body = r.json()
        if path.startswith("/v1/messages"):  # Anthropic's shape
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("case", ACCEPTED)
def test_the_key_opens_every_route(server, case):
    for method, path in sorted(served_routes(server.base_url)):
        r = call(server.base_url, method, path, ACCEPTED[case])
        # An empty body is a 400 on the generation routes; the profiler answers 200 or
        # 400 (no --torch-profiler-dir); nothing is a 401 or a 5xx.
        assert r.status_code not in (401, 403) and r.status_code < 500, (method, path, r.text)
        if method == "GET":
            assert r.status_code == 200, (path, r.text)


def test_unknown_paths_are_closed_too(server):
    for path in ("/v1/nope", "/admin", "/health/", "/metrics/x"):
        assert httpx.post(f"{server.base_url}{path}").status_code == 401, path
    r = httpx.get(f"{server.base_url}/v1/nope", headers=ACCEPTED["bearer"])
    assert r.status_code == 404
