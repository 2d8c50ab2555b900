"""Prometheus metrics of the server (names prefixed ``atom:``) and the stream-silence gauge.

Engine-side numbers arrive with every step's outputs; request latencies are observed in
the frontend when a request finishes; frame gaps are timed where SSE frames leave.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from atom_core.engine.core_messages import EngineStats, SpecDecodeCounts
from atom_core.engine.request_stream import RequestDelta
from atom_core.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

SILENCE_LOG_S = 30.0
_ID = re.compile(rb'"id":\s*"([^"]+)"')
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            metric = Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r)
            return metric.labels(model_name)

        self.running = gauge("atom:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("atom:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge(
            "atom:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)"
        )
        self.prefix_hit_rate = gauge(
            "atom:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens"
        )
        self.prefix_queries = counter(
            "atom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter(
            "atom:prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.prompt_tokens = counter("atom:prompt_tokens", "Prefill tokens computed")
        self.generation_tokens = counter("atom:generation_tokens", "Tokens generated")
        self.preemptions = counter("atom:num_preemptions", "Sequences preempted (recomputed)")
        self.requests_success = Counter(
            "atom:request_success", "Finished requests by finish reason",
            ["model_name", "finished_reason"], registry=r,
        )
        self.ttft = histogram("atom:time_to_first_token_seconds", "Time to first token")
        self.tpot = histogram(
            "atom:time_per_output_token_seconds", "Time per output token after the first"
        )
        self.e2e = histogram("atom:e2e_request_latency_seconds", "End-to-end request latency")
        # Where a request's time went (RequestPhases), observed when it finishes.
        self.phases = {
            "frontend": histogram(
                "atom:request_frontend_time_seconds",
                "HTTP request received to queued to the engine (body, template, tokenization)",
            ),
            "queue": histogram(
                "atom:request_queue_time_seconds", "Engine arrival to first scheduled"
            ),
            "prefill": histogram(
                "atom:request_prefill_time_seconds",
                "First scheduled to first token on the engine's host",
            ),
            "first_token_delivery": histogram(
                "atom:request_first_token_delivery_seconds",
                "First token on the engine's host to its delta handed to the HTTP response",
            ),
            "first_decode": histogram(
                "atom:request_first_decode_time_seconds", "First token to second token (engine)"
            ),
            "decode": histogram(
                "atom:request_decode_time_seconds", "First token to last token (engine)"
            ),
        }
        self.silence = Gauge(
            "atom:stream_longest_silence_seconds",
            "Age of the oldest gap in flight between SSE frames of any stream "
            "(first frame excluded)",
            labels, registry=r,
        ).labels(model_name)
        self.silence.set_function(self.longest_silence)
        self.spec_drafts = counter("atom:spec_decode_num_draft_tokens",
                                   "Draft tokens proposed (speculative decoding)")
        self.spec_accepted = counter("atom:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted (speculative decoding)")
        self.spec_tokens_per_forward = gauge(
            "atom:mtp_average_tokens_per_forward",
            "Tokens a verifying forward emits per sequence, since start: 1 + accepted drafts",
        )
        self.spec: SpecDecodeCounts | None = None  # the latest counts, for /debug/mtp_stats
        self.model_name = model_name
        self._last_frame: dict[int, tuple[str, float]] = {}
        self._seen_queries = self._seen_hits = self._seen_preemptions = 0

    def on_stats(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        queries = s.prefix_cache_queries
        self.prefix_hit_rate.set(s.prefix_cache_hits / queries if queries else 0.0)
        self.prefix_queries.inc(s.prefix_cache_queries - self._seen_queries)
        self.prefix_hits.inc(s.prefix_cache_hits - self._seen_hits)
        self.preemptions.inc(s.num_preemptions - self._seen_preemptions)
        self._seen_queries, self._seen_hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._seen_preemptions = s.num_preemptions
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.generation_tokens)
        if s.spec_decode is not None:
            seen = self.spec
            self.spec_drafts.inc(s.spec_decode.draft_tokens - (seen.draft_tokens if seen else 0))
            self.spec_accepted.inc(
                s.spec_decode.accepted_tokens - (seen.accepted_tokens if seen else 0))
            self.spec = s.spec_decode
            self.spec_tokens_per_forward.set(self.mtp_stats()["average_tokens_per_forward"])

    def mtp_stats(self) -> dict:
        """GET /debug/mtp_stats: speculative decoding's acceptance since start."""
        s = self.spec
        if s is None:
            return {"enabled": False}
        stats = SpecDecodeStats(len(s.accepted_per_position), s.draft_tokens,
                                s.accepted_tokens, s.verifications, list(s.accepted_per_position))
        return {"enabled": True, **stats.as_dict()}

    def on_finished(self, d: RequestDelta) -> None:
        if d.error is not None:
            return
        self.requests_success.labels(self.model_name, d.finish_reason or "unknown").inc()
        if d.ttft_s is not None:
            self.ttft.observe(d.ttft_s)
        if d.latency_s is not None:
            self.e2e.observe(d.latency_s)
            if d.ttft_s is not None and d.num_output_tokens > 1:
                self.tpot.observe((d.latency_s - d.ttft_s) / (d.num_output_tokens - 1))
        if d.phases is not None:
            for name, hist in self.phases.items():
                seconds = getattr(d.phases, name)
                if seconds is not None:
                    hist.observe(seconds)

    def longest_silence(self) -> float:
        now = time.monotonic()
        return max((now - t for _, t in self._last_frame.values()), default=0.0)

    async def timed_frames(
        self, request_id: str, frames: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """Pass SSE frames through, timing the gap before each one after the first."""
        key = id(frames)
        try:
            async with contextlib.aclosing(frames):  # closing us closes the handler's stream
                async for frame in frames:
                    now = time.monotonic()
                    if key not in self._last_frame:
                        m = _ID.search(frame)  # name the request in the silence log line
                        request_id = m.group(1).decode() if m else request_id
                    last = self._last_frame.get(key)
                    if last is not None and now - last[1] > SILENCE_LOG_S:
                        logger.warning("stream %s was silent for %.1f s before this frame",
                                       request_id, now - last[1])
                    self._last_frame[key] = (request_id, now)
                    yield frame
        finally:
            self._last_frame.pop(key, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
