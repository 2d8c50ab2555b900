"""A request is checked (check_request: its prompt, then SamplingParams.validate) once on
its way: in the server's handler (once per prompt, whatever n is) and never again in the
EngineClient or the engine process; in LLMEngine.add_request once per prompt."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from atom_core.engine.core_messages import AddRequest
from atom_core.engine.core_process import EngineCore
from atom_core.engine.llm_engine import LLMEngine
from atom_core.entrypoints.http.app import build_app
from atom_core.entrypoints.server_args import add_server_args
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir
from tests.entrypoints.http.asgi_app import make_app
from tests.entrypoints.http.fake_engine import MODEL, FakeEngineClient

USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The SamplingParams validated in this process, in order."""
    seen: list[SamplingParams] = []
    real = SamplingParams.validate

    def counting(self: SamplingParams) -> None:
        seen.append(self)
        real(self)

    monkeypatch.setattr(SamplingParams, "validate", counting)
    return seen


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(str(tiny_model_dir("llama")), enable_log_stats=False, device="cpu",
                     max_model_len=128)


async def _post(app, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body)


@pytest.mark.parametrize(
    ("path", "body", "checks"),
    [
        ("/v1/chat/completions", {"messages": USER, "n": 3}, 1),
        ("/v1/chat/completions", {"messages": USER, "stream": True}, 1),
        ("/v1/completions", {"prompt": "Hello", "n": 2}, 1),
        ("/v1/completions", {"prompt": [[1, 2], [3]], "stream": True}, 2),
        ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": USER}, 1),
    ],
)
def test_a_handler_checks_each_prompt_once(validations, path, body, checks):
    engine = FakeEngineClient(chat_template="{{ messages[0]['content'] }}")
    response = asyncio.run(_post(make_app(engine), path, body))
    assert response.status_code == 200, response.text
    assert len(validations) == checks
    assert len(engine.calls) == checks * body.get("n", 1)


def test_llm_engine_checks_each_prompt_once(validations, engine):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    engine.generate(["Hello", [1, 2, 3]], params)
    assert validations == [params, params]


def test_the_engine_process_checks_nothing(validations, engine):
    class Push:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def send(self, data: bytes) -> None:
            self.sent.append(data)

    push = Push()
    core = EngineCore(engine, push)
    core.handle(AddRequest("checked", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3)))
    while not engine.is_finished():
        core.step()
    core.step()
    assert validations == []
    assert push.sent  # its tokens went out


@pytest.mark.slow
def test_a_served_request_is_checked_once_in_the_frontend(validations):
    """The real app, EngineClient and engine process: the frontend checks once (the
    engine process runs check_request never, as the test above shows)."""
    args = add_server_args(argparse.ArgumentParser()).parse_args(
        ["--model", str(tiny_model_dir("llama")), "--device", "cpu", "--max-model-len", "128"]
    )
    app = build_app(args)

    started: list[int] = []  # start-up checks the model's generation_config.json once

    async def serve() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            started.append(len(validations))
            body = {"prompt": "Hello", "max_tokens": 4, "n": 2, "stop": ["zzz"]}
            return [await _post(app, "/v1/completions", body),
                    await _post(app, "/v1/completions", {**body, "stream": True})]

    responses = asyncio.run(serve())
    assert [r.status_code for r in responses] == [200, 200]
    assert len(validations) - started[0] == 2
