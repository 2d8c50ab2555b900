"""The frontend's handle on the engine processes: requests out, per-step outputs in.

With ``--data-parallel-size`` N the frontend starts N engine processes (replicas), each with
the whole model and its own link, and sends each request to the replica with the fewest
tokens outstanding (prompt plus the most it may generate, of the requests it holds). One
asyncio task per replica reads its StepOutputs (one message per step for all its streams),
turns each request's new tokens into text (its RequestText: detokenizing, stop strings),
and puts a RequestDelta in that request's StreamOutputCollector. A stop string found here
aborts the request in its replica; so does a consumer that stops reading (a client
disconnect). Requests arrive checked (check_request, in the HTTP handlers). A replica that
dies takes the server with it, as a lone engine's death does.
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
    SpecDecodeCounts,
    StepOutputs,
    TokenOutput,
    Wake,
    encoder,
    from_engine_decoder,
)
from atom_core.engine.output import RequestText
from atom_core.engine.request_stream import (
    RequestDelta,
    RequestPhases,
    StreamOutputCollector,
    received_at,
)
from atom_core.errors import ConfigError, EngineDeadError, InvalidRequestError
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
STARTUP_TIMEOUT_S = 1800.0
WAKE = encoder.encode(Wake())


@dataclass
class _Replica:
    """One engine process and its link."""

    index: int
    link: LinkServer
    process: Any  # multiprocessing's spawned Process
    outstanding: int = 0  # tokens of the requests it holds: prompt + max_tokens
    stats: EngineStats | None = None  # its latest

    @property
    def out(self) -> Any:
        return self.link.out

    @property
    def inp(self) -> Any:
        return self.link.inp


@dataclass
class _Stream:
    collector: StreamOutputCollector
    text: RequestText
    replica: _Replica
    cost: int  # what it adds to its replica's outstanding tokens
    finished: bool = False
    # time.monotonic(): the HTTP request's arrival, its hand-over to the engine, and its
    # first delta's to the response (for RequestPhases).
    received: float | None = None
    sent: float = 0.0
    handed: float | None = None


class EngineClient:
    """Starts the engine processes (one per data-parallel replica) and serves
    EngineClientAPI to the HTTP handlers."""

    def __init__(self, config: Config, served_model_name: str | None = None,
                 waiting: list[WaitingEngine] | None = None) -> None:
        """Opens each replica's engine link (core_link) and starts its engine process, or
        hands its config to one of ``waiting`` (``start_waiting_engines``; those left over
        are stopped), then loads the tokenizer while the engines import and load the model
        (each takes seconds; ~2 s of a 19 s start of the embedded model on a 2-core VM is
        the tokenizer). ``start`` waits for the engines. Call it on the main thread: an
        engine process dies with the thread that started it (PR_SET_PDEATHSIG), and only the
        main thread lives as long as the process."""
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
        self._readers: list[asyncio.Task] = []
        self.replicas: list[_Replica] = []
        waiting = list(waiting or [])
        try:
            for i, replica in enumerate(self.replica_configs(config)):
                self.replicas.append(self._start_replica(i, replica, waiting.pop(0) if waiting
                                                         else None))
        except BaseException:
            self.abandon()
            raise
        finally:
            dismiss(waiting)
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

    @staticmethod
    def replica_configs(config: Config) -> list[Config]:
        """Each replica's engine config. With several, each knows its index (its ranks'
        traces go under ``dp{index}_tp{t}/``), and under DP attention the port on which
        they all meet."""
        par = config.parallel_config
        if par.data_parallel_size == 1:
            return [config]
        port = par.master_port
        if par.enable_dp_attention and port is None:
            from atom_core.distributed.workers import free_port

            port = free_port()
        return [replace(config, parallel_config=replace(par, data_parallel_rank=i,
                                                        master_port=port))
                for i in range(par.data_parallel_size)]

    @staticmethod
    def _start_replica(index: int, config: Config, waiting: WaitingEngine | None) -> _Replica:
        link = LinkServer()
        args = (config, link.link, os.getpid(), logging.getLogger().level)
        try:
            if waiting is not None:
                try:
                    waiting.conn.send(args)
                except OSError:  # it died importing; what it printed is on stderr
                    waiting.process.join(10)
                    raise ConfigError("the engine process exited during start-up (code "
                                      f"{waiting.process.exitcode})") from None
                waiting.conn.close()
                return _Replica(index, link, waiting.process)
            process = _spawn(_engine_main, args, index)
            process.start()
        except BaseException:
            if waiting is not None:
                dismiss([waiting])
            link.close()
            raise
        return _Replica(index, link, process)

    async def start(self) -> None:
        """Wait until every engine process (started in ``__init__``) has loaded its model."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for replica in self.replicas:
            msg = await self._wait_ready(replica, deadline)
        self.ready = msg
        self.max_model_len = msg.max_model_len
        self.vocab_size = msg.vocab_size
        if len(self.tokenizer) > msg.vocab_size:
            logger.warning(
                "the tokenizer has %d tokens, the model's vocabulary %d: prompts holding ids "
                "past it are refused (400)", len(self.tokenizer), msg.vocab_size,
            )
        self._readers = [asyncio.create_task(self._read_loop(r), name=f"atom-engine-reader-{i}")
                         for i, r in enumerate(self.replicas)]

    @staticmethod
    async def _wait_ready(replica: _Replica, deadline: float) -> EngineReady:
        name = f"engine replica {replica.index}" if replica.index else "engine"
        while True:
            if await replica.inp.poll(int(HEALTH_POLL_S * 1000)):
                msg = from_engine_decoder.decode(await replica.inp.recv())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    raise ConfigError(f"the {name} failed to start: {msg.message}")
            elif not replica.process.is_alive():
                code = replica.process.exitcode
                raise ConfigError(f"the {name} process exited during start-up (code {code})")
            elif time.monotonic() > deadline:
                raise ConfigError(f"the {name} did not start in time")

    async def shutdown(self) -> None:
        # After an engine death the processes are on their way out, or stuck there (a
        # broken tensor-parallel group): they are not waited for long.
        dead = self.dead_reason is not None
        for replica in self.replicas:
            if replica.process.is_alive() and not dead:
                try:
                    # Not waiting: a PUSH socket whose peer has closed its end would block
                    # this send forever.
                    await replica.out.send(encoder.encode(Control("shutdown")), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for replica in self.replicas:
            await asyncio.to_thread(replica.process.join, 1 if dead else 10)
            if replica.process.is_alive():
                replica.process.kill()
        for reader in self._readers:
            reader.cancel()
        for replica in self.replicas:
            replica.link.close()

    def abandon(self) -> None:
        """Start-up failed: kill the engine processes (they may still be loading, and would
        not read a shutdown message until done) and close their links."""
        for replica in self.replicas:
            if replica.process.is_alive():
                replica.process.kill()
            replica.process.join(10)
            replica.link.close()

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and all(r.process.is_alive() for r in self.replicas)

    def _check_alive(self) -> None:
        if not self.is_healthy:
            reason = self.dead_reason or "process exited"
            raise EngineDeadError(f"the engine is not running: {reason}")

    # --- the read loop -------------------------------------------------------------------

    async def _read_loop(self, replica: _Replica) -> None:
        name = f"engine replica {replica.index}: " if len(self.replicas) > 1 else ""
        try:
            while True:
                if not await replica.inp.poll(int(HEALTH_POLL_S * 1000)):
                    if not replica.process.is_alive():
                        code = replica.process.exitcode
                        self._engine_died(f"{name}engine process exited (code {code})")
                        return
                    continue
                msg = from_engine_decoder.decode(await replica.inp.recv())
                if isinstance(msg, StepOutputs):
                    self._dispatch(replica, msg)
                elif isinstance(msg, ControlReply):
                    fut = self._replies.pop(msg.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, EngineFailed):
                    self._engine_died(f"{name}{msg.message}")
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

    def _dispatch(self, replica: _Replica, msg: StepOutputs) -> None:
        replica.stats = msg.stats
        stats = msg.stats if len(self.replicas) == 1 else self._all_replicas(msg.stats)
        for listener in self.stats_listeners:
            listener(stats)
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
            replica.out.send(encoder.encode(AbortRequests(stop_aborts)))

    def _all_replicas(self, step: EngineStats) -> EngineStats:
        """The replicas' latest stats as one engine's: counts and cumulative counters summed,
        cache usage averaged; this step's token counts are ``step``'s own."""
        seen = [r.stats for r in self.replicas if r.stats is not None]
        specs = [s.spec_decode for s in seen if s.spec_decode is not None]
        spec = None
        if specs:
            width = max(len(s.accepted_per_position) for s in specs)
            spec = SpecDecodeCounts(
                sum(s.draft_tokens for s in specs), sum(s.accepted_tokens for s in specs),
                sum(s.verifications for s in specs),
                [sum(s.accepted_per_position[i] for s in specs
                     if i < len(s.accepted_per_position)) for i in range(width)])
        return EngineStats(
            sum(s.num_running for s in seen), sum(s.num_waiting for s in seen),
            sum(s.kv_cache_usage for s in seen) / len(self.replicas),
            sum(s.prefix_cache_queries for s in seen), sum(s.prefix_cache_hits for s in seen),
            step.prompt_tokens, step.generation_tokens, sum(s.num_preemptions for s in seen),
            spec,
        )

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
        replica = min(self.replicas, key=lambda r: r.outstanding)
        cost = len(prompt_token_ids) + (params.max_tokens or self.max_model_len)
        stream = _Stream(StreamOutputCollector(), text, replica, cost, received=received_at.get())
        self._streams[request_id] = stream
        replica.outstanding += cost
        # Stop strings are matched here, on text; the engine sees token ids only.
        engine_params = replace(params, stop_strings=None)
        try:
            add = AddRequest(request_id, list(prompt_token_ids), engine_params)
            stream.sent = time.monotonic()
            await replica.out.send(encoder.encode(add))
            if self.config.parallel_config.enable_dp_attention:
                # The others step with it: an idle one waits on its link, not the group.
                for other in self.replicas:
                    if other is not replica:
                        await other.out.send(WAKE)
            while True:
                delta = await stream.collector.get()
                if stream.handed is None:
                    stream.handed = time.monotonic()
                yield delta
                if delta.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            replica.outstanding -= cost
            if not stream.finished and self.is_healthy:
                # Not awaited: this also runs when the consumer was cancelled (disconnect).
                replica.out.send(encoder.encode(AbortRequests([request_id])))

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.collector.put(RequestDelta(request_id, finished=True, finish_reason="abort"))
        if self.is_healthy:
            targets = [stream.replica] if stream is not None else self.replicas
            for replica in targets:
                await replica.out.send(encoder.encode(AbortRequests([request_id])))

    def abort_all(self, reason: str) -> int:
        """End every request in flight now, each with ``reason`` as its error (the server is
        stopping: its handlers answer 503 or a stream's error frame); returns how many."""
        rids = [rid for rid, stream in self._streams.items() if not stream.finished]
        by_replica: dict[int, list[str]] = {}
        for rid in rids:
            stream = self._streams[rid]
            stream.finished = True
            stream.collector.put(
                RequestDelta(rid, finished=True, finish_reason="abort", error=reason)
            )
            by_replica.setdefault(stream.replica.index, []).append(rid)
        if rids and self.is_healthy:
            for index, ids in by_replica.items():  # not awaited, as in generate
                self.replicas[index].out.send(encoder.encode(AbortRequests(ids)))
        return len(rids)

    async def control(self, command: str, timeout: float = 300.0) -> ControlReply:
        """Run an engine command (start_profile, stop_profile) on every replica and wait for
        their replies: the first that failed, else the first."""
        self._check_alive()
        calls = {}
        for replica in self.replicas:
            call_id = next(self._call_ids)
            calls[call_id] = asyncio.get_running_loop().create_future()
            self._replies[call_id] = calls[call_id]
            await replica.out.send(encoder.encode(Control(command, call_id)))
        try:
            replies = await asyncio.wait_for(asyncio.gather(*calls.values()), timeout)
        finally:
            for call_id in calls:
                self._replies.pop(call_id, None)
        return next((r for r in replies if not r.ok), replies[0])

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
            "data_parallel_size": len(self.replicas),
        }


def load_tokenizer(config: Config) -> tuple[Any, str | None]:
    """The loader's (imported here: it imports torch, which the frontend has no need of
    before its engines are started)."""
    from atom_core.loader import load_tokenizer as load

    return load(config)


@dataclass
class WaitingEngine:
    """An engine process started before its config exists: it imports the engine's modules
    while the frontend checks its flags and model (seconds of importing torch on either
    side), then runs the config ``EngineClient`` sends it down ``conn``."""

    process: Any  # multiprocessing's spawned Process
    conn: Any  # the frontend's end of the pipe


def start_waiting_engines(count: int) -> list[WaitingEngine]:
    """``count`` engine processes waiting for their configs. Call it on the main thread
    (see ``EngineClient``), and ``dismiss`` those no EngineClient takes."""
    engines: list[WaitingEngine] = []
    try:
        for index in range(count):
            theirs, ours = mp.get_context("spawn").Pipe(duplex=False)
            process = _spawn(_engine_waits, (theirs,), index)
            process.start()
            theirs.close()
            engines.append(WaitingEngine(process, ours))
    except BaseException:
        dismiss(engines)
        raise
    return engines


def dismiss(engines: list[WaitingEngine]) -> None:
    """Stop waiting engines: killed, as they may be importing for seconds yet."""
    for engine in engines:
        engine.conn.close()
        if engine.process.is_alive():
            engine.process.kill()
        engine.process.join(10)


def _spawn(target: Callable[..., None], args: tuple, index: int) -> Any:
    return mp.get_context("spawn").Process(
        target=target, args=args, daemon=True,
        name=f"atom-engine-core-{index}" if index else "atom-engine-core",
    )


def _engine_waits(conn: Any) -> None:
    """A waiting engine's entry point: the imports first, then the config."""
    from atom_core.engine.core_process import run_engine_core

    try:
        args = conn.recv()
    except EOFError:  # the frontend stopped (or failed its checks) before handing one over
        return
    conn.close()
    run_engine_core(*args)


def _engine_main(*args: Any) -> None:
    """The engine process's entry point. The engine's modules (its loop, the model runner,
    the layers) are imported here, in that process: ``atom serve`` starts it before importing
    its own HTTP stack, and the frontend never needs them."""
    from atom_core.engine.core_process import run_engine_core

    run_engine_core(*args)
