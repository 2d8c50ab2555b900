"""The frontend's handle on the engine process: requests out, per-step outputs in.

One asyncio task reads the engine's StepOutputs (one message per step for all streams),
turns each request's new tokens into text (its RequestText: detokenizing, stop strings),
and puts a RequestDelta in that request's StreamOutputCollector. A stop string found here
aborts the request in the engine; so does a consumer that stops reading (a client
disconnect). Requests arrive checked (check_request, in the HTTP handlers).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import zmq

from atom_core.config import Config
from atom_core.engine.core_link import LinkServer
from atom_core.engine.core_messages import (
    AbortRequests,
    AddRequest,
    Control,
    ControlReply,
    EngineFailed,
    EngineReady,
    EngineStats,
    StepOutputs,
    TokenOutput,
    encoder,
    from_engine_decoder,
)
from atom_core.engine.core_process import run_engine_core
from atom_core.engine.output import RequestText
from atom_core.engine.request_stream import (
    RequestDelta,
    RequestPhases,
    StreamOutputCollector,
    received_at,
)
from atom_core.errors import ConfigError, EngineDeadError, InvalidRequestError
from atom_core.loader import load_tokenizer
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
STARTUP_TIMEOUT_S = 1800.0


@dataclass
class _Stream:
    collector: StreamOutputCollector
    text: RequestText
    finished: bool = False
    # time.monotonic(): the HTTP request's arrival, its hand-over to the engine, and its
    # first delta's to the response (for RequestPhases).
    received: float | None = None
    sent: float = 0.0
    handed: float | None = None


class EngineClient:
    """Starts the engine process and serves EngineClientAPI to the HTTP handlers."""

    def __init__(self, config: Config, served_model_name: str | None = None) -> None:
        """Opens the engine link (core_link) and starts the engine process, then loads the
        tokenizer while the engine imports and loads the model (each takes seconds; ~2 s of a
        19 s start of the embedded model on a 2-core VM is the tokenizer). ``start`` waits for
        the engine. Call it on the main thread: the engine process dies with the thread that
        started it (PR_SET_PDEATHSIG), and only the main thread lives as long as the process."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("EngineClient must be created on the main thread")
        self.config = config
        model = config.model_config.model
        self.model_name = served_model_name or model or "SmolLM2-135M-Instruct"
        self.model_aliases = {self.model_name, model} - {None}
        self.max_model_len = 0
        self.vocab_size = 0
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.stats_listeners: list[Callable[[EngineStats], None]] = []
        self.finish_listeners: list[Callable[[RequestDelta], None]] = []
        self.death_listeners: list[Callable[[str], None]] = []  # called once, with the reason
        self._streams: dict[str, _Stream] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._link = LinkServer()
        self._out = self._link.out
        self._in = self._link.inp
        spawn = mp.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core,
            args=(config, self._link.link, os.getpid(), logging.getLogger().level),
            name="atom-engine-core",
            daemon=True,
        )
        try:
            self.process.start()
        except BaseException:
            self._link.close()
            raise
        try:
            self.tokenizer, self.chat_template = load_tokenizer(config)
            if self.tokenizer is None:
                raise ConfigError(
                    "the server needs a tokenizer: this model has none (pass --tokenizer)"
                )
        except BaseException:
            self.abandon()
            raise

    # --- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Wait until the engine process (started in ``__init__``) has loaded its model."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if await self._in.poll(int(HEALTH_POLL_S * 1000)):
                msg = from_engine_decoder.decode(await self._in.recv())
                if isinstance(msg, EngineReady):
                    break
                if isinstance(msg, EngineFailed):
                    raise ConfigError(f"the engine failed to start: {msg.message}")
            elif not self.process.is_alive():
                code = self.process.exitcode
                raise ConfigError(f"the engine process exited during start-up (code {code})")
            elif time.monotonic() > deadline:
                raise ConfigError("the engine did not start in time")
        self.ready = msg
        self.max_model_len = msg.max_model_len
        self.vocab_size = msg.vocab_size
        if len(self.tokenizer) > msg.vocab_size:
            logger.warning(
                "the tokenizer has %d tokens, the model's vocabulary %d: prompts holding ids "
                "past it are refused (400)", len(self.tokenizer), msg.vocab_size,
            )
        self._reader = asyncio.create_task(self._read_loop(), name="atom-engine-reader")

    async def shutdown(self) -> None:
        if self.process.is_alive():
            try:
                await self._out.send(encoder.encode(Control("shutdown")))
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
        if self._reader is not None:
            self._reader.cancel()
        self._link.close()

    def abandon(self) -> None:
        """Start-up failed: kill the engine process (it may still be loading, and would not
        read a shutdown message until it is done) and close the link."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self._link.close()

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self.process.is_alive()

    def _check_alive(self) -> None:
        if not self.is_healthy:
            reason = self.dead_reason or "process exited"
            raise EngineDeadError(f"the engine is not running: {reason}")

    # --- the read loop -------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                if not await self._in.poll(int(HEALTH_POLL_S * 1000)):
                    if not self.process.is_alive():
                        self._engine_died(f"engine process exited (code {self.process.exitcode})")
                        return
                    continue
                msg = from_engine_decoder.decode(await self._in.recv())
                if isinstance(msg, StepOutputs):
                    self._dispatch(msg)
                elif isinstance(msg, ControlReply):
                    fut = self._replies.pop(msg.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, EngineFailed):
                    self._engine_died(msg.message)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader must not die silently: that would hang every stream
            logger.exception("engine output reader failed")
            self._engine_died(f"output reader failed: {exc}")

    def _engine_died(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("engine is dead: %s", reason)
        for rid, stream in list(self._streams.items()):
            stream.finished = True
            stream.collector.put(
                RequestDelta(rid, finished=True, finish_reason="abort", error=reason)
            )
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        for listener in self.death_listeners:
            listener(reason)

    def _dispatch(self, msg: StepOutputs) -> None:
        for listener in self.stats_listeners:
            listener(msg.stats)
        stop_aborts: list[str] = []
        for out in msg.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.finished:
                continue  # aborted or stopped here already
            delta = self._delta(stream, out)
            if delta.finished and not out.finished:
                stop_aborts.append(out.request_id)  # a stop string ended it here
            if delta.finished:
                stream.finished = True
                if out.timings is not None:
                    handed = stream.handed if stream.handed is not None else time.monotonic()
                    delta.phases = RequestPhases.of(stream.received, stream.sent, handed,
                                                    out.timings)
                for listener in self.finish_listeners:
                    listener(delta)
            stream.collector.put(delta)
        if stop_aborts:
            self._out.send(encoder.encode(AbortRequests(stop_aborts)))

    @staticmethod
    def _delta(stream: _Stream, out: TokenOutput) -> RequestDelta:
        text, finish_reason, stop_reason = stream.text.update(
            out.token_ids, out.finish_reason if out.finished else None, out.stop_reason
        )
        return RequestDelta(
            out.request_id, text, list(out.token_ids), list(out.logprobs),
            out.finished or finish_reason is not None, finish_reason, stop_reason,
            out.num_prompt_tokens, out.num_output_tokens, out.prompt_logprobs,
            out.ttft_s, out.latency_s, out.error,
        )

    # --- EngineClientAPI ----------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestDelta]:
        self._check_alive()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        text = RequestText(self.tokenizer, prompt_token_ids, params)
        stream = _Stream(StreamOutputCollector(), text, received=received_at.get())
        self._streams[request_id] = stream
        # Stop strings are matched here, on text; the engine sees token ids only.
        engine_params = replace(params, stop_strings=None)
        try:
            add = AddRequest(request_id, list(prompt_token_ids), engine_params)
            stream.sent = time.monotonic()
            await self._out.send(encoder.encode(add))
            while True:
                delta = await stream.collector.get()
                if stream.handed is None:
                    stream.handed = time.monotonic()
                yield delta
                if delta.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished and self.is_healthy:
                # Not awaited: this also runs when the consumer was cancelled (disconnect).
                self._out.send(encoder.encode(AbortRequests([request_id])))

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.collector.put(RequestDelta(request_id, finished=True, finish_reason="abort"))
        if self.is_healthy:
            await self._out.send(encoder.encode(AbortRequests([request_id])))

    def abort_all(self, reason: str) -> int:
        """End every request in flight now, each with ``reason`` as its error (the server is
        stopping: its handlers answer 503 or a stream's error frame); returns how many."""
        rids = [rid for rid, stream in self._streams.items() if not stream.finished]
        for rid in rids:
            self._streams[rid].finished = True
            self._streams[rid].collector.put(
                RequestDelta(rid, finished=True, finish_reason="abort", error=reason)
            )
        if rids and self.is_healthy:
            self._out.send(encoder.encode(AbortRequests(rids)))  # not awaited, as in generate
        return len(rids)

    async def control(self, command: str, timeout: float = 300.0) -> ControlReply:
        """Run an engine command (start_profile, stop_profile) and wait for its reply."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._replies[call_id] = fut
        await self._out.send(encoder.encode(Control(command, call_id)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(call_id, None)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def describe(self) -> dict[str, Any]:
        r = self.ready
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "architecture": r.architecture if r else None,
            "num_kv_blocks": r.num_kv_blocks if r else None,
        }
