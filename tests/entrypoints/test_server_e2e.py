"""The real server in a subprocess, driven by the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import signal
import socket
import time

import httpx
import openai
import pytest

from atom_core.entrypoints.server_process import ServerProcess, socket_inodes
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("server")
    srv = ServerProcess(
        tiny_model_dir("llama"), "--max-model-len", "256", "--served-model-name", "tiny",
        "--torch-profiler-dir", str(logs / "traces"), log=logs / "server.log",
    ).wait_ready()
    yield srv
    srv.stop()


KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """A server with --api-key, and with --port (the engine port) set to a port held here,
    as is the next one: test_api_key's and test_the_engine_port_flag_opens_no_tcp_port's,
    one start for both (~10 s on a 2-core VM)."""
    from atom_core.entrypoints.server_process import free_port

    taken = []
    while len(taken) < 2:
        port = free_port()
        taken = [socket.socket(), socket.socket()]
        try:
            for i, sock in enumerate(taken):
                sock.bind(("127.0.0.1", port + i))
                sock.listen()
        except OSError:  # port + 1 is in use already: hold another pair
            for sock in taken:
                sock.close()
            taken = []
    try:
        srv = ServerProcess(tiny_model_dir("llama"), "--max-model-len", "128", "--api-key",
                            "s3cret", "--port", str(port),
                            log=tmp_path_factory.mktemp("keyed") / "log")
        try:
            yield srv.wait_ready()
        finally:
            srv.stop()
    finally:
        for sock in taken:
            sock.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_health_version_models(server):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{server.base_url}/version").json()
    [card] = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert card["id"] == "tiny" and card["max_model_len"] == 256


def test_chat_stream_equals_non_stream(client):
    kw = dict(model="tiny",
              messages=[{"role": "user", "content": "Tell me about paged attention."}],
              temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kw)
    usage = {"include_usage": True}
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options=usage))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [r for r in reasons if r] == ["length"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="The quick brown fox", temperature=0, max_tokens=20)
    full = client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert text == full.choices[0].text
    in_extra = "usage" in (full.model_extra or {})
    extra = full.model_extra["usage"] if in_extra else full.usage.model_extra
    assert {"ttft_s", "tpot_s", "latency_s"} <= set(extra)


def test_stop_strings_and_n(client):
    base = client.completions.create(model="tiny", prompt="Hello", temperature=0, max_tokens=30)
    text = base.choices[0].text
    stop = text[8:11]
    cut = client.completions.create(
        model="tiny", prompt="Hello", temperature=0, max_tokens=30, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    many = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, n=3, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]


def test_64_concurrent_streams_each_get_their_own(server):
    """Each client has its own prompt length and max_tokens, so cross-talk cannot hide."""
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[int, int, int, str]:
        stream = await aclient.completions.create(
            model="tiny", prompt="a" * (i + 1), max_tokens=1 + i % 17, temperature=0.8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return i, usage.prompt_tokens, usage.completion_tokens, text

    async def run():
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(run())
    single = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    for i, prompt_tokens, completion_tokens, _ in results:
        alone = single.completions.create(model="tiny", prompt="a" * (i + 1), max_tokens=1)
        expect = alone.usage.prompt_tokens
        assert (prompt_tokens, completion_tokens) == (expect, 1 + i % 17)


BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 400}]}, 400, None),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
     404, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, None),
    ("/v1/completions", {}, 400, "prompt"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input_gets_openai_error_shape(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{server.base_url}{path}", content=content, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    body = {"prompt": "still alive", "max_tokens": 2}
    ok = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert ok.status_code == 200


def test_disconnect_mid_stream_frees_kv(server):
    body = {"prompt": "disconnect me", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = metric(server, "atom:num_requests_running")
        if running == 0 and metric(server, "atom:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    assert metric(server, "atom:num_requests_running") == 0
    assert metric(server, "atom:kv_cache_usage_perc") == 0


def test_metrics_count_tokens(server):
    before = metric(server, "atom:generation_tokens_total")
    body = {"prompt": "count", "max_tokens": 7, "ignore_eos": True}
    httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert metric(server, "atom:generation_tokens_total") - before == 7
    assert metric(server, "atom:stream_longest_silence_seconds") == 0


PHASES = ("frontend_time", "queue_time", "prefill_time", "first_token_delivery",
          "first_decode_time", "decode_time")


def test_time_split_of_a_request_adds_up_to_what_the_client_saw(server):
    names = [f"atom:request_{p}_seconds" for p in PHASES]
    count0 = {n: metric(server, n + "_count") for n in names}
    sum0 = {n: metric(server, n + "_sum") for n in names}
    body = {"prompt": "split me", "max_tokens": 6, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - start
        total = time.monotonic() - start
    spent = {}
    for n in names:
        assert metric(server, n + "_count") - count0[n] == 1, n
        spent[n.split(":")[1]] = metric(server, n + "_sum") - sum0[n]
    assert all(v >= 0 for v in spent.values()), spent
    before_first = sum(spent[f"request_{p}_seconds"] for p in PHASES[:4])
    assert 0 < before_first <= first, (spent, first)
    assert spent["request_prefill_time_seconds"] > 0
    assert spent["request_first_decode_time_seconds"] <= spent["request_decode_time_seconds"]
    assert spent["request_decode_time_seconds"] <= total


def test_profile_endpoints_write_a_trace(server, tmp_path_factory):
    assert httpx.post(f"{server.base_url}/start_profile").status_code == 200
    httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "profile me", "max_tokens": 4})
    r = httpx.post(f"{server.base_url}/stop_profile", timeout=120)
    assert r.status_code == 200, r.text
    trace = r.json()["message"]  # the reply comes once the trace is written
    assert trace.endswith(".json.gz") and os.path.basename(os.path.dirname(trace)) == "rank_0"
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    assert any("forward" in e.get("name", "") or e.get("ph") == "X" for e in events)


def test_api_key(keyed_server):
    srv = keyed_server
    url = f"{srv.base_url}/v1/models"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url, headers=KEY).status_code == 200
    assert httpx.get(url, headers={"x-api-key": "s3cret"}).status_code == 200  # Anthropic's SDK
    # Every route that acts needs the key, not only /v1 (tests/reliability/test_auth.py
    # runs the whole matrix); probes, scrapers and the version stay open.
    assert httpx.post(f"{srv.base_url}/start_profile").status_code == 401
    assert httpx.post(f"{srv.base_url}/stop_profile").status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{srv.base_url}{path}").status_code == 200, path


def test_engine_death_is_reported_not_hung(tmp_path):
    """An idle server whose engine dies exits non-zero at once, for its supervisor to
    restart it (tests/reliability/test_engine_death.py kills it under a stream)."""
    model = tiny_model_dir("llama")
    srv = ServerProcess(model, "--max-model-len", "128", log=tmp_path / "log").wait_ready()
    try:
        [engine_pid] = srv.engine_pids()
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        assert srv.proc.wait(10) == 1
        assert time.monotonic() - killed < 2.0
        assert "the engine process died" in srv.log()
    finally:
        srv.stop()


def test_stop_token_text_is_not_in_the_output(server):
    """The server's text for a stop-token finish equals the in-process engine's (which
    never detokenizes the stop token), streamed and not."""
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    engine = LLMEngine(str(tiny_model_dir("llama")), device="cpu", enable_log_stats=False,
                       max_model_len=256)
    prompt = engine.tokenize("Hello there")
    [ref] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    # A stop token with visible text of its own (random weights emit many partial bytes).
    stop = next(t for t in ref["token_ids"][1:] if engine.tokenizer.decode([t]).strip().isascii()
                and engine.tokenizer.decode([t]).strip())
    [want] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop_token_ids=[stop]))
    url = f"{server.base_url}/v1/completions"
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [stop]}
    cut = httpx.post(url, json=body).json()["choices"][0]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)
    assert cut["text"] == want["text"]
    assert not want["text"].endswith(engine.tokenizer.decode([stop]))
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"]
                       for line in r.iter_lines() if line.startswith("data: {"))
    assert text == want["text"]


def listening_tcp_ports(pids: list[int]) -> set[int]:
    """The TCP ports these processes listen on (/proc: their socket inodes in LISTEN state)."""
    inodes = set().union(*(socket_inodes(pid) for pid in pids))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_engine_port_flag_opens_no_tcp_port(keyed_server):
    """--port (the serving guide's "internal engine communication port") is accepted and
    unused: a server starts with that port and the next taken, and listens on its HTTP
    port only (the engine link is private IPC)."""
    srv = keyed_server
    body = {"prompt": "x", "max_tokens": 2}
    r = httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=KEY, timeout=30)
    assert r.status_code == 200
    assert listening_tcp_ports([srv.proc.pid, *srv.engine_pids()]) == {srv.port}
