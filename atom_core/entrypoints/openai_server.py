"""The HTTP app (FastAPI) in front of the engine process: OpenAI's and Anthropic's routes,
auth, health, metrics and profiling. ``server_runtime`` runs it under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from atom_core import __version__
from atom_core.engine.annotations import profiler_timeout
from atom_core.engine.arg_utils import EngineArgs
from atom_core.entrypoints.metrics import ServerMetrics
from atom_core.entrypoints.openai.engine_client import EngineClient
from atom_core.entrypoints.openai.errors_http import error_response, install_error_handlers
from atom_core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from atom_core.entrypoints.openai.serving_chat import (
    OpenAIServingChat,
    check_parser_names,
    resolve_chat_parser,
)
from atom_core.entrypoints.openai.serving_completion import OpenAIServingCompletion
from atom_core.entrypoints.openai.serving_messages import (
    AnthropicServingMessages,
    anthropic_error_response,
)
from atom_core.errors import AtomError, AuthenticationError, EngineDeadError

logger = logging.getLogger("atom.server")


def build_app(
    args: argparse.Namespace, on_engine_death: Callable[[str], None] | None = None
) -> FastAPI:
    """The app; ``on_engine_death(reason)`` is called once if the engine process dies."""
    config = EngineArgs.from_cli_args(args).create_config()
    stop_timeout = profiler_timeout()  # ATOM_PROFILER_TIMEOUT; a bad value fails at start-up
    check_parser_names(args.tool_call_parser, args.reasoning_parser)  # before any weights load
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = EngineClient(config, args.served_model_name)  # the engine starts loading
        try:
            # Resolved once, from the chat template, while the engine loads (and logged).
            parser, encoder = resolve_chat_parser(
                client, config.model_config.model, args.tool_call_parser, args.reasoning_parser
            )
            await client.start()
        except BaseException:
            client.abandon()
            raise
        if on_engine_death is not None:
            client.death_listeners.append(on_engine_death)
        metrics = ServerMetrics(client.model_name)
        client.stats_listeners.append(metrics.on_stats)
        client.finish_listeners.append(metrics.on_finished)
        chat = OpenAIServingChat(client, parser=parser, encoder=encoder)
        state.update(client=client, metrics=metrics, chat=chat, messages=AnthropicServingMessages(chat),
                     completion=OpenAIServingCompletion(client))
        logger.info("serving %s on http://%s:%d", client.model_name, args.host, args.server_port)
        try:
            yield
        finally:
            await client.shutdown()

    app = FastAPI(title="ATOM", version=__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.middleware("http")
    async def api_key_auth(request: Request, call_next):
        if args.api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            # Anthropic's SDK sends the key as x-api-key.
            token = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), args.api_key.encode()):
                err = AuthenticationError("missing or invalid API key")
                if request.url.path.startswith("/v1/messages"):
                    return anthropic_error_response(err)
                return error_response(err)
        return await call_next(request)

    def timed(response: Response, request_id: str) -> Response:
        if isinstance(response, StreamingResponse):
            response.body_iterator = state["metrics"].timed_frames(request_id, response.body_iterator)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return timed(await state["chat"].create(request, raw_request), "chat")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return timed(await state["completion"].create(request, raw_request), "completion")

    @app.post("/v1/messages")
    async def messages(raw_request: Request) -> Response:
        # The body is parsed by the handler: its errors are Anthropic-shaped.
        return timed(await state["messages"].handle(raw_request), "messages")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        client = state["client"]
        card = {"id": client.model_name, "object": "model", "created": 0, "owned_by": "atom",
                "root": client.model_name, "max_model_len": client.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        client = state["client"]
        if not client.is_healthy:
            return error_response(EngineDeadError(client.dead_reason or "engine process exited"))
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["metrics"].render(), media_type=CONTENT_TYPE_LATEST)

    async def profile(command: str) -> Response:
        try:
            reply = await state["client"].control(command, timeout=stop_timeout)
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
            return error_response(
                EngineDeadError(f"{command} did not finish within {stop_timeout:g} s (ATOM_PROFILER_TIMEOUT)")
            )
        if not reply.ok:
            return error_response(AtomError(reply.message), status=400)
        return JSONResponse({"status": "ok", "message": reply.message})

    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await profile("start_profile")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await profile("stop_profile")

    return app
