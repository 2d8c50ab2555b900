"""The engine process: a busy loop of receive requests -> step -> send outputs.

It owns the model and the KV cache; the server's frontend talks to it over two ZMQ
sockets (requests in, one StepOutputs message per engine step out), a private link
(core_link). Text stays with the frontend: this process sends token ids. It dies with the
frontend: PR_SET_PDEATHSIG, and a getppid check every loop iteration.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time

import zmq

from atom_core.config import Config
from atom_core.distributed.workers import RankWorkers
from atom_core.engine.core_link import EngineLink
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
    to_engine_decoder,
)
from atom_core.engine.llm_engine import LLMEngine, RequestOutput
from atom_core.engine.profiler import TraceWrite
from atom_core.errors import AtomError, EngineDeadError

logger = logging.getLogger("atom.engine_core")

# How long an idle engine waits on its link. Under DP attention an idle group also agrees
# this often; a request sent to any replica wakes the others at once (``Wake``).
IDLE_POLL_MS = 100
# A woken replica keeps agreeing (no idle wait) until the group agrees some replica has work,
# or this long: its Wake may be read, and agreed on, before the request's replica reads the
# request itself.
WAKE_S = 1.0
WORKER_WATCH_S = 0.2  # how often the tensor-parallel workers are checked (_watch_workers)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class EngineCore:
    def __init__(self, engine: LLMEngine, push: zmq.Socket) -> None:
        self.engine = engine
        self.push = push
        self.pending: list[TokenOutput] = []
        self.running = True
        self.dirty = False  # an abort changed the engine's state: report it even if idle
        self.woken_until = 0.0  # DP attention: a Wake keeps this replica agreeing until then
        self.trace_replies: list[tuple[int, TraceWrite]] = []  # stop_profile: sent once written

    def _collect(self, out: RequestOutput) -> None:
        self.pending.append(
            TokenOutput(
                out.request_id, out.token_ids, out.finished, out.finish_reason, out.stop_reason,
                out.logprobs, out.prompt_logprobs, out.num_prompt_tokens, out.num_output_tokens,
                out.ttft_s, out.latency_s, timings=out.timings,
            )
        )

    def is_idle(self) -> bool:
        """Nothing to step or report: the loop may wait on the link. Under DP attention also
        no replica of the group has work, and no Wake is waiting to be agreed on."""
        idle = self.engine.is_finished() and not self.pending and not self.dirty
        lockstep = self.engine.lockstep
        if lockstep is None:
            return idle
        return idle and not lockstep.any_busy and time.monotonic() >= self.woken_until

    def handle(self, msg: AddRequest | AbortRequests | Control | Wake) -> None:
        if isinstance(msg, Wake):
            self.woken_until = time.monotonic() + WAKE_S
        elif isinstance(msg, AddRequest):
            try:
                # Checked by the frontend (check_request) before it was sent.
                self.engine.add_checked_request(
                    msg.prompt_token_ids, msg.params, msg.request_id, self._collect
                )
            except AtomError as exc:  # refused (a request id in flight): to that request only
                self.pending.append(TokenOutput(msg.request_id, [], True, "abort", error=str(exc)))
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.dirty |= self.engine.abort_request(rid)
        elif (reply := self._control(msg)) is not None:
            self.push.send(encoder.encode(reply))

    def _control(self, msg: Control) -> ControlReply | None:
        try:
            if msg.command == "start_profile":
                self.engine.start_profile()
            elif msg.command == "stop_profile":
                write = self.engine.stop_profile_nowait()
                if write is None:
                    return ControlReply(msg.call_id, True, "profiler was not running")
                self.trace_replies.append((msg.call_id, write))  # answered by step()
                return None
            elif msg.command == "shutdown":
                self.running = False
            else:
                return ControlReply(msg.call_id, False, f"unknown command {msg.command!r}")
        except AtomError as exc:
            return ControlReply(msg.call_id, False, str(exc))
        return ControlReply(msg.call_id, True)

    def step(self) -> None:
        lockstep = self.engine.lockstep
        if lockstep is not None:  # DP attention: step with the other replicas, or stop
            busy = not self.engine.is_finished()
            if lockstep.step(stop=not self.running):
                self.running = False
                return
            if lockstep.any_busy:
                self.woken_until = 0.0  # the group has agreed on the work a Wake announced
            if busy:
                self.engine.profiler.step()
        elif not self.engine.is_finished():
            self.engine.step()
            self.engine.profiler.step()
        for call_id, write in [r for r in self.trace_replies if r[1].done()]:
            self.trace_replies.remove((call_id, write))
            try:
                reply = ControlReply(call_id, True, str(write.result()))
            except AtomError as exc:
                reply = ControlReply(call_id, False, str(exc))
            self.push.send(encoder.encode(reply))
        if not self.pending and not self.dirty and self.engine.is_finished():
            return
        self.dirty = False
        bm = self.engine.block_manager
        prompt, gen = self.engine.last_step_tokens
        self.engine.last_step_tokens = (0, 0)
        spec = self.engine.speculator
        stats = EngineStats(
            self.engine.scheduler.num_running, self.engine.scheduler.num_waiting, bm.usage,
            bm.prefix_cache_queries, bm.prefix_cache_hits, prompt, gen, self.engine.num_preemptions,
            None if spec is None else SpecDecodeCounts(
                spec.stats.total_draft_tokens, spec.stats.total_accepted_tokens,
                spec.stats.num_verifications, list(spec.stats.accepted_per_position)),
        )
        outputs, self.pending = self.pending, []
        self.push.send(encoder.encode(StepOutputs(outputs, stats)))


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (the
    frontend's main thread): immediate even mid-step, where a poll of getppid would wait for
    the step to end. Linux only; elsewhere the per-iteration getppid check is the watch."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if libc.prctl(PR_SET_PDEATHSIG, *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def _watch_workers(workers: RankWorkers, stopping: threading.Event) -> None:
    """A tensor-parallel worker that dies is seen by the next collective, which raises; a
    wait that no error ends (a peer lost between a collective's sends) would hang the
    engine and every stream. So a watch: a worker's death ends this process, named in the
    log, and the frontend fails fast as for the engine's own death."""
    while not stopping.wait(WORKER_WATCH_S):
        try:
            workers.check()
        except EngineDeadError as exc:
            if stopping.is_set():
                return
            logger.error("%s; engine exiting", exc)
            logging.shutdown()
            os._exit(1)


def run_engine_core(
    config: Config, link: EngineLink, parent: int, log_level: int = logging.INFO
) -> None:
    """Entry point of the engine process (spawned by the frontend's EngineClient, whose pid
    is ``parent``); ``link`` says where and with which keys to connect."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    if os.getppid() != parent:  # the frontend died before the watch was set
        logger.info("frontend is gone before the engine started; engine exiting")
        return
    ctx = zmq.Context()
    pull = link.connect(ctx, zmq.PULL, link.to_engine)
    push = link.connect(ctx, zmq.PUSH, link.from_engine)
    try:
        engine = LLMEngine(config=config, detokenize=False)
        engine.warmup()
    except Exception as exc:  # report why, so the frontend can say it instead of hanging
        if not isinstance(exc, AtomError):  # an AtomError's message is all there is to say
            logger.exception("engine failed to start")
        push.send(encoder.encode(EngineFailed(f"{type(exc).__name__}: {exc}")))
        return
    hf = engine.hf_config
    push.send(encoder.encode(EngineReady(
        engine.max_model_len, hf.vocab_size, engine.runner.num_blocks,
        config.cache_config.block_size, (getattr(hf, "architectures", None) or ["?"])[0],
    )))
    core = EngineCore(engine, push)
    # The model, its tensors and the warm-up's objects live as long as the process: frozen
    # out of the collector's sight, so a full collection mid-serving does not walk them.
    gc.collect()
    gc.freeze()
    # Ctrl+C, or a SIGTERM to the whole group (systemd, ServerProcess.stop), is the
    # frontend's to act on: it drains its requests, then sends "shutdown".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stopping = threading.Event()
    if engine.ranks is not None:
        threading.Thread(target=_watch_workers, args=(engine.ranks.workers, stopping),
                         name="atom-tp-watch", daemon=True).start()
    try:
        while core.running:
            if os.getppid() != parent:  # the watch without PDEATHSIG too; one cheap syscall
                logger.info("frontend is gone; engine exiting")
                break
            if pull.poll(IDLE_POLL_MS if core.is_idle() else 0):
                while True:
                    try:
                        raw = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    core.handle(to_engine_decoder.decode(raw))
            core.step()
    except Exception as exc:
        logger.exception("engine step failed")
        push.send(encoder.encode(EngineFailed(f"{type(exc).__name__}: {exc}")))
    finally:
        stopping.set()
        engine.profiler.stop()
        engine.shutdown()  # its tensor-parallel workers, if any, exit with it
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()
