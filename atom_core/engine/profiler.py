"""torch.profiler traces on demand (LLMEngine.start_profile / stop_profile, /start_profile).

Traces go to ``{torch_profiler_dir}/rank_0/`` (TensorBoard format, gzip), the directory
named by --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR. ATOM_PROFILER_MORE=1 adds
shapes, stacks and memory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

from atom_core.errors import ConfigError

logger = logging.getLogger(__name__)


def profiler_dir(configured: str | None) -> str | None:
    return configured or os.environ.get("ATOM_TORCH_PROFILER_DIR") or None


class TorchProfiler:
    def __init__(self, trace_dir: str | None, rank: int = 0) -> None:
        self.trace_dir = Path(trace_dir) / f"rank_{rank}" if trace_dir else None
        self._prof: profile | None = None

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
            activities=activities,
            record_shapes=more,
            with_stack=more,
            profile_memory=more,
            on_trace_ready=tensorboard_trace_handler(str(self.trace_dir), use_gzip=True),
        )
        self._prof.start()
        logger.info("torch profiler started; traces go to %s", self.trace_dir)

    def stop(self) -> Path | None:
        """Stop and write the trace; returns the directory (None if nothing was running)."""
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        prof.stop()
        logger.info("torch profiler stopped; trace written to %s", self.trace_dir)
        return self.trace_dir
