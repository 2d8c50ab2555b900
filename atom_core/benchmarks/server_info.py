"""What the benchmark asks the server before a run: GET /v1/models, for the card of the model
it sends requests to.

ATOM's card (``owned_by: "atom"``) names the served tokenizer's vocabulary, special ids and
whether it has a chat template; with /tokenize and /detokenize that is the whole tokenizer
(tokenizer.ServerTokenizer), so ``atom bench serve`` needs no --tokenizer against ``atom
serve``. The card also tells the run that /debug/mtp_stats is there: no other server is
asked for it, so their logs get no 404 from the benchmark. Only the OpenAI-compatible
backends are asked (every such server has /v1/models); TGI, TensorRT-LLM and DeepSpeed-MII
are asked nothing.
"""

from __future__ import annotations

import http.client
import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from atom_core.errors import ConfigError

OPENAI_BACKENDS = frozenset({"vllm", "openai", "openai-chat", "lmdeploy", "scalellm", "sglang"})


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer $OPENAI_API_KEY`` when the variable is set, as vLLM's
    benchmark sends it: a server started with --api-key answers nothing else."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class JsonClient:
    """Blocking JSON requests over one kept-alive connection: the prompts are built before
    the run, one request after another, and a connection per request would cost more
    than the request."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 timeout_s: float = 60.0) -> None:
        parts = urlsplit(base_url)
        https = parts.scheme == "https"
        kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
        self._conn = kind(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self.base_url = base_url

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, the reply's JSON, or its text when it is not JSON). Raises OSError or
        http.client.HTTPException when the server cannot be reached."""
        payload = None if body is None else json.dumps(body)
        for attempt in (0, 1):
            try:
                self._conn.request(method, self._prefix + path, payload, self._headers)
                reply = self._conn.getresponse()
                data = reply.read()
                break
            except (OSError, http.client.HTTPException):
                # The server may close a kept-alive connection between two requests: one
                # retry on a fresh connection (these requests change nothing).
                self._conn.close()
                if attempt:
                    raise
        try:
            return reply.status, json.loads(data)
        except ValueError:
            return reply.status, data.decode(errors="replace")

    def close(self) -> None:
        self._conn.close()


@dataclass(frozen=True)
class ServedModel:
    """The card GET /v1/models gives for the model a run names."""

    id: str
    atom: bool  # an ATOM server: /tokenize, /detokenize and /debug/mtp_stats are there
    tokenizer: dict[str, Any] | None  # ATOM's tokenizer entry: vocab_size, special_ids, ...


def served_model(client: JsonClient, name: str | None) -> ServedModel | None:
    """The card of model ``name`` (else the first one listed); None when the server
    answers no model list."""
    try:
        status, body = client.request("GET", "/v1/models")
    except (OSError, http.client.HTTPException):
        return None
    if status == 401:  # every request of the run would be refused the same way
        raise ConfigError(f"{client.base_url} refused the API key (HTTP 401): set "
                          "OPENAI_API_KEY to the server's --api-key")
    cards = body.get("data") if status == 200 and isinstance(body, dict) else None
    cards = [c for c in cards or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    if not cards:
        return None
    card = next((c for c in cards if c["id"] == name), cards[0])
    tokenizer = card.get("tokenizer")
    return ServedModel(id=card["id"], atom=card.get("owned_by") == "atom",
                       tokenizer=tokenizer if isinstance(tokenizer, dict) else None)
