"""The HTTP app (FastAPI) in front of the engine process: OpenAI's and Anthropic's routes,
vLLM's /tokenize and /detokenize, health, metrics and profiling. ``server_runtime`` runs
it under uvicorn.

Every request passes, outermost first: X-Request-Id (request_id), the API key and the body
size (guards), then, on the generation routes, admission, disconnect and timeout
(admission); all pure ASGI middleware."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import msgspec
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp

from atom_core import __version__
from atom_core.engine.annotations import profiler_timeout
from atom_core.engine.arg_utils import EngineArgs
from atom_core.engine.client import EngineClient
from atom_core.entrypoints.http.admission import (
    AdmissionQueue,
    FirstTokenWatch,
    GenerationGuard,
    RequestLimits,
)
from atom_core.entrypoints.http.anthropic.messages import AnthropicServingMessages
from atom_core.entrypoints.http.errors import error_response, install_error_handlers
from atom_core.entrypoints.http.guards import ApiKeyMiddleware, BodySizeLimitMiddleware
from atom_core.entrypoints.http.json_body import JSONBodyRoute
from atom_core.entrypoints.http.metrics import ServerMetrics
from atom_core.entrypoints.http.openai.chat import OpenAIServingChat, resolve_chat_parser
from atom_core.entrypoints.http.openai.completions import OpenAIServingCompletion
from atom_core.entrypoints.http.openai.protocol import ChatCompletionRequest, CompletionRequest
from atom_core.entrypoints.http.openapi import install_openapi
from atom_core.entrypoints.http.request_id import RequestIdMiddleware, install_log_filter
from atom_core.entrypoints.http.tokenization import DetokenizeRequest, ServingTokenization
from atom_core.errors import AtomError, EngineDeadError
from atom_core.generation_defaults import GenerationDefaults
from atom_core.parsing.response import check_parser_names

logger = logging.getLogger("atom.server")


class AtomApp(FastAPI):
    """FastAPI with X-Request-Id outside its error middleware, so that a 500 carries the
    id and its log line names it."""

    def build_middleware_stack(self) -> ASGIApp:
        return RequestIdMiddleware(super().build_middleware_stack())


def build_app(
    args: argparse.Namespace,
    on_engine_death: Callable[[str], None] | None = None,
    started: EngineClient | None = None,
) -> FastAPI:
    """The app; ``on_engine_death(reason)`` is called once if the engine process dies.
    ``started``: the engine already started for ``args`` (server_runtime starts it before
    importing this module, so the engine loads meanwhile), which the app's start-up then
    waits for; without one, the start-up starts the engine."""
    if started is not None:
        config = started.config
    else:
        config = EngineArgs.from_cli_args(args).create_config()
    stop_timeout = profiler_timeout()  # ATOM_PROFILER_TIMEOUT; a bad value fails at start-up
    check_parser_names(args.tool_call_parser, args.reasoning_parser)  # before any weights load
    m = config.model_config
    defaults = GenerationDefaults.resolve(m.generation_config, m.model)
    logger.info("request defaults: %s", defaults.describe())
    # --chat-template replaces a model-side Python encoder too, not only the Jinja one.
    encoder_dir = None if m.chat_template is not None else m.model
    limits = RequestLimits.from_args(args)
    queue = AdmissionQueue(limits.max_queued) if limits.max_queued is not None else None
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The engine starts loading here unless it already is.
        client = started if started is not None else EngineClient(config, args.served_model_name)
        try:
            # What the handlers need is built while the engine loads: the chat template's
            # parser (resolved once, and logged), the serving objects, a first collection.
            parser, encoder = resolve_chat_parser(
                client, encoder_dir, args.tool_call_parser, args.reasoning_parser
            )
            metrics = ServerMetrics(client.model_name)
            # The handlers' engine: with a bounded queue, one that marks each first token.
            engine = FirstTokenWatch(client) if queue is not None else client
            chat = OpenAIServingChat(engine, parser=parser, encoder=encoder, defaults=defaults)
            tokenization = ServingTokenization(chat)
            state.update(metrics=metrics, chat=chat, tokenization=tokenization,
                         tokenizer_info=msgspec.to_builtins(tokenization.info()),
                         messages=AnthropicServingMessages(chat),
                         completion=OpenAIServingCompletion(engine, defaults=defaults))
            gc.collect()
            await client.start()
        except BaseException:
            client.abandon()
            raise
        if on_engine_death is not None:
            client.death_listeners.append(on_engine_death)
        client.stats_listeners.append(metrics.on_stats)
        client.finish_listeners.append(metrics.on_finished)
        state["client"] = client
        app.state.engine_client = client  # server_runtime aborts what a shutdown's drain left
        remove_log_filter = install_log_filter()  # uvicorn's logging is configured by now
        # What start-up made (tokenizer, templates, app) lives as long as the server: out
        # of the collector's sight, so full collections stay short while requests stream.
        gc.freeze()
        logger.info("serving %s on http://%s:%d", client.model_name, args.host, args.server_port)
        try:
            yield
        finally:
            remove_log_filter()
            await client.shutdown()

    app = AtomApp(title="ATOM", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.router.route_class = JSONBodyRoute  # bodies parsed in ms, not 100 ms of the loop
    install_openapi(app)
    # add_middleware puts each one outside the ones before it.
    app.add_middleware(GenerationGuard, limits=limits, queue=queue)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)

    def timed(response: Response, request_id: str) -> Response:
        if isinstance(response, StreamingResponse):
            frames = response.body_iterator
            response.body_iterator = state["metrics"].timed_frames(request_id, frames)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        limits.check(1, request.n)
        return timed(await state["chat"].create(request, raw_request), "chat")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        limits.check(len(request.prompt), request.n)
        return timed(await state["completion"].create(request, raw_request), "completion")

    @app.post("/v1/messages")
    async def messages(raw_request: Request) -> Response:
        # The body is parsed by the handler: its errors are Anthropic-shaped.
        return timed(await state["messages"].handle(raw_request), "messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request) -> Response:
        return await state["messages"].handle_count_tokens(raw_request)

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> Response:
        # Either form, told apart by its keys in the handler (tokenization.tokenize_request).
        return await state["tokenization"].tokenize(body)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return await state["tokenization"].detokenize(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        client = state["client"]
        card = {"id": client.model_name, "object": "model", "created": 0, "owned_by": "atom",
                "root": client.model_name, "max_model_len": client.max_model_len,
                "tokenizer": state["tokenizer_info"]}
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

    @app.get("/debug/mtp_stats")
    async def mtp_stats() -> JSONResponse:
        return JSONResponse(state["metrics"].mtp_stats())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["metrics"].render(), media_type=CONTENT_TYPE_LATEST)

    async def profile(command: str) -> Response:
        try:
            reply = await state["client"].control(command, timeout=stop_timeout)
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
            return error_response(EngineDeadError(
                f"{command} did not finish within {stop_timeout:g} s (ATOM_PROFILER_TIMEOUT)"
            ))
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
