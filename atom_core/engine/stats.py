"""The periodic engine-status line (--enable-log-stats / --throughput-log-interval)."""

from __future__ import annotations

import logging
import time
from typing import Any

from atom_core.config import ObservabilityConfig

logger = logging.getLogger("atom.engine")


class StatsLogger:
    def __init__(self, config: ObservabilityConfig, scheduler: Any, block_manager: Any) -> None:
        self.enabled = config.enable_log_stats
        self.interval = config.throughput_log_interval
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.last = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def record(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        now = time.monotonic()
        if not self.enabled or now - self.last < self.interval:
            return
        elapsed = now - self.last
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
            "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
            "prefix cache hit rate: %.1f%%",
            self.prompt_tokens / elapsed, self.generation_tokens / elapsed,
            self.scheduler.num_running, self.scheduler.num_waiting,
            100 * self.block_manager.usage, 100 * self.block_manager.prefix_cache_hit_rate,
        )
        self.last = now
        self.prompt_tokens = self.generation_tokens = 0
