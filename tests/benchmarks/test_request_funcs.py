"""Every backend's request function against the instant-streaming test double."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from atom_core.benchmarks import fake_server
from atom_core.benchmarks.backend_request_func import (
    ASYNC_REQUEST_FUNCS,
    RequestFuncInput,
    make_session,
    set_session,
)
from atom_core.benchmarks.benchmark_serving import benchmark
from atom_core.benchmarks.client_ceiling import peak_in_flight, start_fake_server
from atom_core.benchmarks.datasets import SampleRequest

PATHS = {"tgi": "/generate_stream", "tensorrt-llm": "/generate_stream",
         "deepspeed-mii": "/generate", "openai-chat": "/v1/chat/completions"}


async def with_server(config, body):
    runner, port = await fake_server.start(fake_server.build_app(config))
    try:
        return await body(f"http://127.0.0.1:{port}", runner.app[fake_server.COUNTERS])
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("backend", sorted(ASYNC_REQUEST_FUNCS))
def test_each_backend_times_every_chunk(backend):
    async def body(url, counters):
        rfi = RequestFuncInput(prompt="hello", api_url=url + PATHS.get(backend, "/v1/completions"),
                               prompt_len=5, output_len=12, model="fake")
        return await ASYNC_REQUEST_FUNCS[backend](request_func_input=rfi)

    out = asyncio.run(with_server(fake_server.FakeConfig(chunk_interval_s=0.002), body))
    assert out.success, out.error
    assert out.ttft > 0 and out.latency >= out.ttft
    if backend == "deepspeed-mii":  # not streamed: one "chunk"
        assert out.itl == [] and out.generated_text == "x" * 12
        return
    assert len(out.itl) == 11 and all(x > 0 for x in out.itl)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    assert out.generated_text == "x" * 12
    if backend in ("vllm", "openai", "openai-chat", "sglang", "lmdeploy", "scalellm", "tgi"):
        assert out.output_tokens == 12


def test_http_error_and_error_frame_fail_the_request():
    async def body(url, counters):
        bad = RequestFuncInput(prompt="x", api_url=url + "/v1/nope/completions", prompt_len=1,
                               output_len=2, model="m")
        return await ASYNC_REQUEST_FUNCS["vllm"](request_func_input=bad)

    out = asyncio.run(with_server(None, body))
    assert not out.success and "HTTP 404" in out.error


def test_merged_chunks_inflate_itl_not_tpot():
    reqs = [SampleRequest("p", 1, 41)] * 4

    async def body(url, counters):
        return await benchmark(backend="vllm", api_url=url + "/v1/completions", base_url=url,
                               model_id="fake", model_name=None, requests=reqs, disable_tqdm=True)

    config = fake_server.FakeConfig(tokens_per_chunk=4, chunk_interval_s=0.01)
    res = asyncio.run(with_server(config, body))
    assert res["completed"] == 4 and res["total_output_tokens"] == 4 * 41
    assert all(len(itl) == 10 for itl in res["itls"])  # 41 tokens in 11 chunks
    assert res["itl_tpot_merge_factor"] == pytest.approx(4.0, rel=0.15)


@pytest.mark.slow
def test_one_process_drives_1000_concurrent_streams(capsys):
    n = 1000
    reqs = [SampleRequest("p", 1, 20)] * n
    # The server in its own process, so the client's process does only the client's work.
    # Each stream stays open ~1 s (20 chunks 50 ms apart), so all are in flight together.
    proc, url = start_fake_server("--chunk-interval-ms", "50")
    try:
        res = asyncio.run(benchmark(backend="vllm", api_url=url + "/v1/completions", base_url=url,
                                    model_id="fake", model_name=None, requests=reqs,
                                    disable_tqdm=True, profile=True))
        counters = httpx.get(url + "/metrics").json()
    finally:
        proc.terminate()
        proc.wait()
    assert res["completed"] == n and res["failed"] == 0
    assert counters["start_profile"] == counters["stop_profile"] == 1
    assert peak_in_flight(res["start_times"], res["e2els"]) == n
    # The server paces chunks at 50 ms; a client that fell behind would stretch the gaps
    # (loose: this box's two cores are shared).
    assert res["mean_itl_ms"] < 50 * 2
    assert "Successful requests:                     1000" in capsys.readouterr().out


def test_session_can_be_shared():
    async def body(url, counters):
        session = make_session()
        set_session(session)
        try:
            rfi = RequestFuncInput(prompt="x", api_url=url + "/v1/completions", prompt_len=1,
                                   output_len=3, model="m")
            request = ASYNC_REQUEST_FUNCS["vllm"]
            outs = await asyncio.gather(*(request(request_func_input=rfi) for _ in range(5)))
        finally:
            set_session(None)
            await session.close()
        return outs

    assert all(o.success for o in asyncio.run(with_server(None, body)))
