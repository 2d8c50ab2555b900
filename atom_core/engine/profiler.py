"""torch.profiler traces on demand (LLMEngine.start_profile / stop_profile, /start_profile).

Each rank's traces go to its own directory under the one named by --torch-profiler-dir or
ATOM_TORCH_PROFILER_DIR (``rank_trace_dir``: ``rank_0/`` for a lone engine), in TensorBoard
format, gzip. ATOM_PROFILER_MORE=1 adds
shapes, stacks and memory.

Ending a trace costs the thread that profiled: torch collects the events and kineto
writes them as JSON there (kineto's state is that thread's, and its export holds the
GIL, so neither can move to a thread), about 5-8 ms per profiled step of the tiny test
model on a 2-core VM. The server's engine loop therefore counts its steps (``step``) and
ends a trace by itself after ATOM_PROFILER_MAX_STEPS of them, which bounds that pause.
Compressing the JSON, the larger part of the old cost, runs in a child process at low
priority (``TraceWrite``); the trace's ``.json.gz`` appears, complete, when it is done.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from atom_core.engine.annotations import profiler_max_steps
from atom_core.errors import AtomError, ConfigError

logger = logging.getLogger(__name__)

# Run by ``python -I -c``: gzip argv[1] into argv[2], then remove argv[1]. The .part name
# keeps a half-written file from matching *.json.gz.
_GZIP = """\
import gzip, os, shutil, sys
os.nice(10)
src, dst = sys.argv[1:]
with open(src, "rb") as f, gzip.open(dst + ".part", "wb", compresslevel=6) as g:
    shutil.copyfileobj(f, g, 1 << 20)
os.replace(dst + ".part", dst)
os.unlink(src)
"""


def profiler_dir(configured: str | None) -> str | None:
    return configured or os.environ.get("ATOM_TORCH_PROFILER_DIR") or None


class TraceWrite:
    """One trace's JSON being compressed into ``path`` by a child process: no GIL shared
    with the engine loop, and at nice 10 it takes about a tenth of a CPU the engine wants."""

    def __init__(self, json_path: Path, path: Path) -> None:
        self.path = path
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _GZIP, str(json_path), str(path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def done(self) -> bool:
        return self._proc.poll() is not None

    def result(self) -> Path:
        """Wait until written; the trace's path, or AtomError saying why it was not written."""
        _, err = self._proc.communicate()
        if self._proc.returncode != 0:
            reason = err.decode(errors="replace").strip().splitlines()[-1:] or ["killed"]
            raise AtomError(f"writing the trace {self.path} failed: {reason[0]}")
        return self.path


def rank_trace_dir(base: str, tp_rank: int, tp_size: int, dp_rank: int | None) -> Path:
    """Where one rank writes its traces, as the serving guide lays them out: ``rank_{t}``
    for tensor-parallel rank t; under data parallelism ``dp{d}_tp{t}/rank_{r}``, r being
    the rank's index over all replicas' ranks."""
    if dp_rank is None:
        return Path(base) / f"rank_{tp_rank}"
    return Path(base) / f"dp{dp_rank}_tp{tp_rank}" / f"rank_{dp_rank * tp_size + tp_rank}"


def rank_profiler(config: Any, tp_rank: int) -> TorchProfiler:
    """The profiler of tensor-parallel rank ``tp_rank`` of the engine ``config`` describes."""
    base = profiler_dir(config.observability_config.torch_profiler_dir)
    par = config.parallel_config
    return TorchProfiler(
        None if base is None
        else rank_trace_dir(base, tp_rank, par.tensor_parallel_size, par.data_parallel_rank))


@dataclass(frozen=True)
class ProfileOrder:
    """Rank 0 to the other ranks, in the stream of step batches: start (or stop) tracing."""

    start: bool


class TorchProfiler:
    def __init__(self, trace_dir: Path | str | None, max_steps: int | None = None) -> None:
        """``trace_dir``: this rank's own directory (``rank_trace_dir``), None when no
        profiler directory is configured."""
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.max_steps = profiler_max_steps() if max_steps is None else max_steps  # 0: no cap
        self._prof: profile | None = None
        self._steps = 0
        self._unclaimed: TraceWrite | None = None  # the latest trace, not yet handed out
        self._writes: list[TraceWrite] = []
        if self.trace_dir is not None:
            self._warm_up()

    @staticmethod
    def _warm_up() -> None:
        """Start and stop an empty trace: the first start of a process initializes kineto,
        seconds (3.8 s on a loaded 2-core VM) that would otherwise stall the engine loop at
        the first /start_profile rather than its start-up."""
        warm = profile(activities=[ProfilerActivity.CPU])
        warm.start()
        warm.stop()

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        if self.trace_dir is None:
            raise ConfigError("profiling needs --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR")
        if self._prof is not None:
            return
        more = os.environ.get("ATOM_PROFILER_MORE") == "1"
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(
            activities=activities, record_shapes=more, with_stack=more, profile_memory=more,
        )
        self._prof.start()
        self._steps = 0
        cap = f"at most {self.max_steps} steps" if self.max_steps else "no step cap"
        logger.info("torch profiler started (%s); traces go to %s", cap, self.trace_dir)

    def step(self) -> None:
        """One engine step done: past ``max_steps`` of them the trace ends here."""
        if self._prof is None:
            return
        self._steps += 1
        if self.max_steps and self._steps >= self.max_steps:
            self._end("its step cap (ATOM_PROFILER_MAX_STEPS)")

    def stop_nowait(self) -> TraceWrite | None:
        """End the trace (if one is recording) and return the latest trace being written,
        once: None if there is none since the last call."""
        if self._prof is not None:
            self._end("stop_profile")
        claimed, self._unclaimed = self._unclaimed, None
        return claimed

    def stop(self) -> Path | None:
        """End the trace and wait until every trace is written; returns the directory
        (None if nothing was running)."""
        claimed = self.stop_nowait()
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()
        return self.trace_dir if claimed is not None else None

    def _end(self, why: str) -> None:
        prof, self._prof = self._prof, None
        start = time.perf_counter()
        prof.stop()
        name = f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"
        json_path = self.trace_dir / f"{name}.tmp"
        prof.export_chrome_trace(str(json_path))
        pause_ms = (time.perf_counter() - start) * 1e3
        write = TraceWrite(json_path, self.trace_dir / f"{name}.gz")
        self._writes = [w for w in self._writes if not w.done()] + [write]
        self._unclaimed = write
        logger.info("torch profiler stopped by %s after %d steps (%.0f ms to collect); "
                    "compressing the trace to %s", why, self._steps, pause_ms, write.path)
