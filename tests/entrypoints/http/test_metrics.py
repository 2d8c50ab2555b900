import asyncio
import logging

from atom_core.engine.core_messages import EngineStats
from atom_core.engine.request_stream import RequestDelta, RequestPhases
from atom_core.engine.sequence import RequestTimings
from atom_core.entrypoints.http import metrics as metrics_mod
from atom_core.entrypoints.http.metrics import ServerMetrics


def value(m: ServerMetrics, name: str) -> float:
    for line in m.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_engine_stats_become_gauges_and_counters():
    m = ServerMetrics("tiny")
    m.on_stats(EngineStats(3, 2, 0.25, 100, 40, 50, 3, 1))
    m.on_stats(EngineStats(1, 0, 0.1, 150, 60, 0, 1, 1))
    assert value(m, "atom:num_requests_running") == 1
    assert value(m, "atom:num_requests_waiting") == 0
    assert value(m, "atom:kv_cache_usage_perc") == 0.1
    assert value(m, "atom:prefix_cache_hit_rate") == 60 / 150
    assert value(m, "atom:prefix_cache_queries_total") == 150
    assert value(m, "atom:prompt_tokens_total") == 50
    assert value(m, "atom:generation_tokens_total") == 4
    assert value(m, "atom:num_preemptions_total") == 1


def test_latency_histograms_from_finished_requests():
    m = ServerMetrics("tiny")
    m.on_finished(RequestDelta("r", finished=True, finish_reason="length", num_output_tokens=11,
                               ttft_s=0.2, latency_s=1.2))
    assert value(m, "atom:time_to_first_token_seconds_count") == 1
    assert value(m, "atom:time_per_output_token_seconds_sum") == 0.1
    assert value(m, "atom:e2e_request_latency_seconds_sum") == 1.2


def test_phases_of_a_request_from_both_processes_timestamps():
    t = RequestTimings(arrival=10.0, scheduled=10.5, first_token=11.0, second_token=11.25,
                       finished=13.0)
    p = RequestPhases.of(received=9.75, sent=9.875, handed=11.125, t=t)
    assert p == RequestPhases(frontend=0.125, queue=0.5, prefill=0.5, first_token_delivery=0.125,
                              first_decode=0.25, decode=2.0)
    # Outside HTTP there is no arrival; a one-token request has no second token.
    t1 = RequestTimings(arrival=1.0, scheduled=1.0, first_token=2.0, second_token=None,
                        finished=2.0)
    p1 = RequestPhases.of(received=None, sent=0.5, handed=2.5, t=t1)
    assert p1.frontend is None and p1.first_decode is None and p1.decode == 0.0


def test_phase_histograms_observe_what_a_request_had():
    m = ServerMetrics("tiny")
    phases = RequestPhases(frontend=None, queue=0.5, prefill=0.25, first_token_delivery=0.125,
                           first_decode=None, decode=2.0)
    m.on_finished(RequestDelta("r", finished=True, finish_reason="length", phases=phases))
    assert value(m, "atom:request_queue_time_seconds_sum") == 0.5
    assert value(m, "atom:request_prefill_time_seconds_sum") == 0.25
    assert value(m, "atom:request_first_token_delivery_seconds_sum") == 0.125
    assert value(m, "atom:request_decode_time_seconds_sum") == 2.0
    assert value(m, "atom:request_frontend_time_seconds_count") == 0
    assert value(m, "atom:request_first_decode_time_seconds_count") == 0


def test_silence_gauge_times_gaps_after_the_first_frame(monkeypatch, caplog):
    m = ServerMetrics("tiny")
    monkeypatch.setattr(metrics_mod, "SILENCE_LOG_S", 0.02)
    observed = []

    async def frames():
        await asyncio.sleep(0.05)  # the wait for the first frame is admission, not silence
        observed.append(m.longest_silence())
        yield b'data: {"id":"cmpl-42"}\n\n'
        await asyncio.sleep(0.05)
        observed.append(m.longest_silence())
        yield b"data: [DONE]\n\n"

    async def run():
        async for _ in m.timed_frames("completion", frames()):
            pass

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    assert observed[0] == 0 and observed[1] >= 0.04
    assert m.longest_silence() == 0
    assert "stream cmpl-42 was silent" in caplog.text
