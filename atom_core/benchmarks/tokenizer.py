"""The benchmark's tokenizer: transformers' AutoTokenizer on local files (no network), or
the served model's own, through the server (ServerTokenizer)."""

from __future__ import annotations

import http.client
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from atom_core.benchmarks.server_info import JsonClient
from atom_core.errors import ConfigError


def get_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """AutoTokenizer for a model directory, a tokenizer directory or a ``.gguf`` file.

    Only local files are read: a benchmark that silently downloads a tokenizer measures
    the wrong thing when the download picks another revision than the server's.
    """
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer GGUF file {path} does not exist")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    if not path.exists() and os.sep not in name_or_path and "/" not in name_or_path:
        raise FileNotFoundError(
            f"tokenizer {name_or_path!r} is not a local path (pass --tokenizer DIR)")
    return AutoTokenizer.from_pretrained(str(path) if path.exists() else name_or_path, **kwargs)


class ServerTokenizer:
    """The served model's tokenizer, through the server: POST /tokenize and /detokenize
    (vLLM's routes) for ids and text, and ``info`` (ATOM's /v1/models card entry) for its
    vocabulary, special ids and chat template. Only what the datasets and the counts use:
    ``encode``, ``decode``, ``apply_chat_template``, ``vocab_size``, ``all_special_ids``
    and ``chat_template`` (true when the server has one).

    The ids are the server's own, its --chat-template included, whichever machine the
    benchmark runs on, and nothing is loaded here. Each call is one request (about a
    millisecond on the same host), made while the prompts are built, before the run."""

    def __init__(self, client: JsonClient, info: dict[str, Any]) -> None:
        self.client = client
        try:
            self.vocab_size = int(info["vocab_size"])
            self.all_special_ids = [int(t) for t in info["special_ids"]]
            self.chat_template = bool(info["chat_template"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{client.base_url}/v1/models: a malformed tokenizer entry "
                              f"{info!r} (pass --tokenizer)") from exc
        # A sampled prompt is encoded again to count it: the second time is free.
        self._encode = lru_cache(maxsize=4096)(self._encode_uncached)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encode(text, add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": [int(t) for t in token_ids]})["prompt"]

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str | list[int]:
        """The server's rendering of ``messages``, as /v1/chat/completions renders it."""
        ids = self._post("/tokenize", {"messages": messages,
                                       "add_generation_prompt": add_generation_prompt})["tokens"]
        return ids if tokenize else self.decode(ids)

    def _encode_uncached(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
        body = {"prompt": text, "add_special_tokens": add_special_tokens}
        return tuple(self._post("/tokenize", body)["tokens"])

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        where = f"{self.client.base_url}{path}"
        try:
            status, reply = self.client.request("POST", path, body)
        except (OSError, http.client.HTTPException) as exc:
            raise ConfigError(f"the server's tokenizer at {where} failed: {exc!r}") from exc
        if status != 200 or not isinstance(reply, dict):
            raise ConfigError(f"the server's tokenizer at {where} answered HTTP {status}: "
                              f"{str(reply)[:300]}")
        return reply
