"""What the benchmark reads of a server before a run (server_info), its server-side tokenizer's
refusals, and the failed requests' error summary; against a scripted stand-in server."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from atom_core.benchmarks.benchmark_serving import error_summary
from atom_core.benchmarks.server_info import JsonClient, auth_headers, served_model
from atom_core.benchmarks.tokenizer import ServerTokenizer
from atom_core.errors import ConfigError

ATOM_CARD = {"id": "tiny", "object": "model", "owned_by": "atom",
             "tokenizer": {"vocab_size": 320, "special_ids": [0, 1], "chat_template": True}}


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each path with ``replies[path]`` (status, JSON); records every request."""

    protocol_version = "HTTP/1.1"  # kept-alive connections, as real servers keep them
    replies: dict[str, tuple[int, Any]] = {}
    seen: list[tuple[str, str, dict[str, str]]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.seen.append((self.command, self.path, dict(self.headers)))
        status, body = self.replies.get(self.path, (404, {"detail": "Not Found"}))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.path == "/close":  # drops the kept-alive connection, unannounced
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    Scripted.replies, Scripted.seen = {}, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)


def test_the_named_models_card_and_whether_the_server_is_atom(stand_in):
    other = {"id": "other", "owned_by": "vllm"}
    Scripted.replies["/v1/models"] = (200, {"object": "list", "data": [other, ATOM_CARD]})
    client = JsonClient(stand_in)
    served = served_model(client, "tiny")
    assert served is not None and (served.id, served.atom) == ("tiny", True)
    assert served.tokenizer == ATOM_CARD["tokenizer"]
    first = served_model(client, "not-listed")  # the first card, as vLLM's benchmark takes
    assert first is not None and (first.id, first.atom, first.tokenizer) == ("other", False, None)
    client.close()


def test_no_model_list_is_no_card_and_a_refused_key_is_one_error(stand_in, monkeypatch):
    client = JsonClient(stand_in)
    assert served_model(client, "tiny") is None  # 404: not an OpenAI-compatible server
    Scripted.replies["/v1/models"] = (200, {"data": "nonsense"})
    assert served_model(client, "tiny") is None
    Scripted.replies["/v1/models"] = (401, {"error": {"message": "bad key"}})
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        served_model(client, "tiny")
    monkeypatch.setenv("OPENAI_API_KEY", "s3cret")
    JsonClient(stand_in, auth_headers()).request("GET", "/v1/models")
    assert Scripted.seen[-1][2]["Authorization"] == "Bearer s3cret"


def test_a_connection_the_server_closed_is_reopened(stand_in):
    Scripted.replies["/close"] = (200, {"ok": 1})
    Scripted.replies["/x"] = (200, {"ok": 2})
    client = JsonClient(stand_in)
    assert client.request("POST", "/close", {}) == (200, {"ok": 1})
    assert client.request("POST", "/x", {}) == (200, {"ok": 2})


def test_the_server_tokenizer_refuses_in_one_error(stand_in):
    Scripted.replies["/tokenize"] = (200, {"count": 2, "max_model_len": 64, "tokens": [5, 6]})
    Scripted.replies["/detokenize"] = (400, {"error": {"message": "token id 999 is not in "
                                                      "the vocabulary [0, 320)"}})
    tok = ServerTokenizer(JsonClient(stand_in), ATOM_CARD["tokenizer"])
    assert (tok.vocab_size, tok.all_special_ids, tok.chat_template) == (320, [0, 1], True)
    assert tok.encode("hi") == [5, 6] and tok.encode("hi") == [5, 6]
    assert len([s for s in Scripted.seen if s[1] == "/tokenize"]) == 1  # the second was cached
    with pytest.raises(ConfigError, match="HTTP 400.*token id 999"):
        tok.decode([999])
    with pytest.raises(ConfigError, match="malformed tokenizer entry"):
        ServerTokenizer(JsonClient(stand_in), {"vocab_size": "many"})


def test_error_summary_lists_the_first_distinct_errors_with_counts():
    assert error_summary([]) == []
    trace = "Traceback (most recent call last):\n  File x\nConnectionResetError: reset"
    errors = ["HTTP 400: a", trace, "HTTP 400: a", *(f"HTTP 500: {i}" for i in range(6)), trace]
    lines = error_summary(errors)
    assert lines[0] == "Failed requests: 10 (8 distinct errors, the first 5 shown)"
    assert lines[1:] == ["     2 x HTTP 400: a", "     2 x ConnectionResetError: reset",
                         "     1 x HTTP 500: 0", "     1 x HTTP 500: 1", "     1 x HTTP 500: 2"]
