"""The serving handlers on a bare FastAPI app (no engine process) and a client for it: what
the handler tests drive their fake engines (fake_engine.py, scripted_engine.py) through."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import httpx
from fastapi import Body, FastAPI, Request
from fastapi.responses import Response

from atom_core.entrypoints.http.anthropic.messages import AnthropicServingMessages
from atom_core.entrypoints.http.errors import install_error_handlers
from atom_core.entrypoints.http.openai.chat import OpenAIServingChat
from atom_core.entrypoints.http.openai.completions import OpenAIServingCompletion
from atom_core.entrypoints.http.openai.protocol import ChatCompletionRequest, CompletionRequest
from atom_core.entrypoints.http.tokenization import DetokenizeRequest, ServingTokenization


def make_app(engine: Any, **chat_kw: Any) -> FastAPI:
    """Chat, completions, Anthropic messages and (de)tokenization over ``engine`` (an
    EngineClientAPI); the completions route shares the chat handler's ``defaults``
    (GenerationDefaults)."""
    app = FastAPI()
    install_error_handlers(app)
    chat = OpenAIServingChat(engine, **chat_kw)
    completion = OpenAIServingCompletion(engine, defaults=chat_kw.get("defaults"))
    messages, tokenization = AnthropicServingMessages(chat), ServingTokenization(chat)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create(request, raw_request)

    @app.post("/v1/messages")
    async def anthropic_messages(raw_request: Request) -> Response:
        return await messages.handle(raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request) -> Response:
        return await messages.handle_count_tokens(raw_request)

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> Response:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return await tokenization.detokenize(request)

    return app


def async_client(app: FastAPI) -> httpx.AsyncClient:
    # An exception escaping the app becomes the 500 a client would see, not a test crash.
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def post(target: FastAPI | Any, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    """POST to an app, or to a fresh ``make_app(target)`` when given an engine."""
    app = target if isinstance(target, FastAPI) else make_app(target)

    async def go() -> httpx.Response:
        async with async_client(app) as client:
            if isinstance(body, bytes):
                headers = {"content-type": "application/json"}
                return await client.post(path, content=body, headers=headers)
            return await client.post(path, json=body)

    return asyncio.run(go())


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON of each data frame; the last entry is the string "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.content.split(b"\n\n")
    assert frames[-1] == b""
    out = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ")
        data = frame[6:]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out
