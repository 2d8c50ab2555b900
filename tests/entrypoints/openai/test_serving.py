"""The chat and completions handlers behind a small FastAPI app, on a scripted engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from atom_core.engine.sequence import Logprob
from atom_core.entrypoints.openai.errors_http import install_error_handlers
from atom_core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from atom_core.entrypoints.openai.serving_chat import OpenAIServingChat
from atom_core.entrypoints.openai.serving_completion import OpenAIServingCompletion
from atom_core.entrypoints.openai.serving_engine import EngineJob, stream_deltas
from atom_core.entrypoints.openai.streaming_dispatch import RequestDelta
from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import SamplingParams
from tests.tiny_tokenizer import tiny_tokenizer

MODEL = "fake-model"
USER = [{"role": "user", "content": "Hello world!"}]


class FakeEngineClient:
    """EngineClientAPI on a script: the reply's tokens one delta each (the reply names the
    seed, so seeded choices differ). Records every request and every abort (a request
    closed before its finished delta)."""

    def __init__(
        self,
        *,
        reply: str = "The quick brown fox",
        max_model_len: int = 128,
        endless: bool = False,
        error: str | None = None,
        raises: Exception | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.model_name = MODEL
        self.model_aliases = {MODEL, "/models/fake"}
        self.max_model_len = max_model_len
        self.tokenizer = tiny_tokenizer()
        self.chat_template = chat_template
        self.reply, self.endless, self.error, self.raises = reply, endless, error, raises
        self.calls: list[tuple[list[int], SamplingParams, str]] = []
        self.aborted: list[str] = []
        self.frames_sent = 0

    @property
    def is_healthy(self) -> bool:
        return True

    def reply_ids(self, params: SamplingParams) -> list[int]:
        text = self.reply if params.seed is None else f"{self.reply} {params.seed}"
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        self.calls.append((list(prompt_token_ids), params, request_id))
        if self.raises is not None:
            raise self.raises
        done = False
        try:
            if self.error:
                yield RequestDelta(
                    request_id, finished=True, finish_reason="abort", error=self.error
                )
                done = True
                return
            ids = self.reply_ids(params)
            vocab = len(self.tokenizer)
            n = 0
            while True:
                tid = ids[n % len(ids)]
                n += 1
                total = len(prompt_token_ids) + n
                length = n >= params.max_tokens or total >= self.max_model_len
                finished = not self.endless and (length or n == len(ids))
                delta = RequestDelta(
                    request_id,
                    text=self.tokenizer.decode([tid]),
                    token_ids=[tid],
                    finished=finished,
                    finish_reason=("length" if length else "stop") if finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=n,
                    ttft_s=0.5 if n == 1 else None,
                    latency_s=0.5 + 0.1 * (n - 1) if finished else None,
                )
                if params.logprobs is not None:
                    top = [(tid, -0.5)] + [((tid + k) % vocab, -0.5 - k) for k in range(1, 20)]
                    delta.logprobs = [Logprob(tid, -0.5, 1, top[: params.logprobs])]
                if n == 1 and params.prompt_logprobs is not None:
                    k = params.prompt_logprobs
                    delta.prompt_logprobs = [None] + [
                        Logprob(t, -1.0, 2, [((t + 1) % vocab, -0.25), (t, -1.0)][:k])
                        for t in prompt_token_ids[1:]
                    ]
                self.frames_sent += 1
                yield delta
                if finished:
                    done = True
                    return
                await asyncio.sleep(0.005 if self.endless else 0)
        finally:
            if not done:
                self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def make_app(engine: FakeEngineClient) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    chat, completion = OpenAIServingChat(engine), OpenAIServingCompletion(engine)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create(request, raw_request)

    return app


def post(engine: FakeEngineClient, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(make_app(engine), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            if isinstance(body, bytes):
                headers = {"content-type": "application/json"}
                return await client.post(path, content=body, headers=headers)
            return await client.post(path, json=body)

    return asyncio.run(go())


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON of each data frame; the last entry is the string "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.content.split(b"\n\n")
    assert frames[-1] == b""
    out = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ")
        data = frame[6:]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def chat_stream_text(events: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
    return texts


def assert_error(
    response: httpx.Response, status: int, param: str | None = ..., type_: str | None = None
):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["code"] == status
    if param is not ...:
        assert body["error"]["param"] == param
    if type_ is not None:
        assert body["error"]["type"] == type_
    return body["error"]


# ------------------------------------------------------------------------------ chat


def test_chat_non_streaming():
    engine = FakeEngineClient()
    r = post(engine, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 50})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert choice["message"] == {
        "role": "assistant", "content": engine.reply, "reasoning_content": None, "tool_calls": None
    }
    usage = body["usage"]
    n_out = len(engine.tokenizer.encode(engine.reply))
    [(prompt_ids, params, rid)] = engine.calls
    assert rid == body["id"] + "-0" and params.max_tokens == 50
    assert usage["prompt_tokens"] == len(prompt_ids) and usage["completion_tokens"] == n_out
    assert usage["total_tokens"] == len(prompt_ids) + n_out
    assert usage["ttft_s"] == 0.5 and usage["latency_s"] == pytest.approx(0.5 + 0.1 * (n_out - 1))
    assert usage["tpot_s"] == pytest.approx(0.1)


def test_chat_prompt_is_the_rendered_template_without_added_special_tokens():
    engine = FakeEngineClient()
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    post(engine, "/v1/chat/completions", {"messages": [system, *USER]})
    tok = engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *USER],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert engine.calls[0][0] == tok.encode(text, add_special_tokens=False)


def test_tools_and_chat_template_kwargs_reach_the_template():
    template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
        "tools={{ tools | length if tools else 0 }} flag={{ flag }}"
        "{% if add_generation_prompt %} go{% endif %}"
    )
    engine = FakeEngineClient(chat_template=template)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"messages": USER, "tools": tools, "tool_choice": "auto",
            "chat_template_kwargs": {"flag": "on", "tokenize": True}}  # fmt: skip
    assert post(engine, "/v1/chat/completions", body).status_code == 200
    prompt = engine.tokenizer.decode(engine.calls[0][0])
    assert prompt == "user:Hello world!\ntools=1 flag=on go"


def test_past_tool_calls_reach_the_template_with_object_arguments():
    template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
        "{% endfor %}\n{% endfor %}"
    )
    engine = FakeEngineClient(chat_template=template)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert post(engine, "/v1/chat/completions", {"messages": messages}).status_code == 200
    prompt = engine.tokenizer.decode(engine.calls[0][0])
    assert '[f {"x": 1}]' in prompt and prompt.endswith("tool:42")


def test_developer_role_is_sent_as_system_to_a_template_that_does_not_know_it():
    engine = FakeEngineClient()
    post(
        engine, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "x"}, *USER]}
    )
    assert engine.tokenizer.decode(engine.calls[0][0]).startswith("<|im_start|>system\nx")


def test_chat_streaming_agrees_with_non_streaming():
    body = {"messages": USER, "max_tokens": 50, "stream_options": {"include_usage": True}}
    full = post(FakeEngineClient(), "/v1/chat/completions", body).json()
    events = sse_events(post(FakeEngineClient(), "/v1/chat/completions", {**body, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks
    )
    assert len({c["id"] for c in events[:-1]}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chat_stream_text(events) == {0: full["choices"][0]["message"]["content"]}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "stop"
    ]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]


def test_chat_stream_without_include_usage_has_no_usage_chunk():
    events = sse_events(
        post(FakeEngineClient(), "/v1/chat/completions", {"messages": USER, "stream": True})
    )
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert all(e["choices"] for e in events[:-1])


def test_chat_n_choices_get_their_own_requests_and_seeds():
    engine = FakeEngineClient()
    body = {"messages": USER, "n": 3, "seed": 10}
    full = post(engine, "/v1/chat/completions", body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert [rid for _, _, rid in engine.calls] == [f"{full['id']}-{i}" for i in range(3)]
    assert [p.seed for _, p, _ in engine.calls] == [10, 11, 12]
    texts = [c["message"]["content"] for c in full["choices"]]
    assert texts == [f"{engine.reply} {s}" for s in (10, 11, 12)]
    n_out = sum(len(engine.tokenizer.encode(t)) for t in texts)
    assert full["usage"]["completion_tokens"] == n_out
    assert full["usage"]["prompt_tokens"] == len(engine.calls[0][0])  # counted once

    events = sse_events(post(FakeEngineClient(), "/v1/chat/completions", {**body, "stream": True}))
    assert chat_stream_text(events) == dict(enumerate(texts))
    finals = [ch for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]]
    assert sorted(ch["index"] for ch in finals) == [0, 1, 2]
    firsts = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            firsts.setdefault(ch["index"], ch["delta"])
    assert all(d["role"] == "assistant" for d in firsts.values())


def test_chat_logprobs_shape():
    engine = FakeEngineClient()
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2}
    full = post(engine, "/v1/chat/completions", body).json()
    content = full["choices"][0]["logprobs"]["content"]
    ids = engine.tokenizer.encode(engine.reply)
    assert [c["token"] for c in content] == [engine.tokenizer.decode([t]) for t in ids]
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["logprob"] == -0.5 and first["bytes"] == list(first["token"].encode())
    assert len(first["top_logprobs"]) == 2
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    events = sse_events(post(FakeEngineClient(), "/v1/chat/completions", {**body, "stream": True}))
    # The role frame and the finish frame carry none of their own.
    streamed = [
        lp for e in events[:-1] for ch in e["choices"] if ch["logprobs"] for lp in ch["logprobs"]["content"]
    ]
    assert streamed == content


def test_finish_reason_length_at_max_tokens():
    full = post(
        FakeEngineClient(), "/v1/chat/completions", {"messages": USER, "max_tokens": 2}
    ).json()
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 2


def test_max_tokens_past_the_context_is_not_clipped_the_engine_stops_at_max_model_len():
    engine = FakeEngineClient(max_model_len=40, endless=False, reply="The quick brown fox " * 10)
    r = post(engine, "/v1/chat/completions", {"messages": USER, "max_tokens": 1000})
    assert r.status_code == 200
    assert engine.calls[0][1].max_tokens == 1000
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 40


def test_model_path_alias_and_absent_model_are_accepted():
    for model in ("/models/fake", MODEL, None, ""):
        body = {"messages": USER} if model is None else {"model": model, "messages": USER}
        assert post(FakeEngineClient(), "/v1/chat/completions", body).status_code == 200


# ---------------------------------------------------------------------------- errors


BAD_CHAT = [
    (b'{"messages": [', 400, None),
    (b"not json at all", 400, None),
    (b"[1, 2]", 400, None),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ({"messages": USER, "max_tokens": "many"}, 400, "max_tokens"),
    ({"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": USER, "max_tokens": -5}, 400, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    ({"messages": USER, "n": 0}, 400, "n"),
    ({"messages": USER, "top_p": 0}, 400, "top_p"),
    ({"messages": USER, "temperature": -1}, 400, "temperature"),
    ({"messages": USER, "stop": [""]}, 400, "stop"),
    ({"messages": USER, "stop": 3}, 400, "stop"),
    ({"messages": USER, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": USER, "tool_choice": 3}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x " * 200}]}, 400, "messages"),
    ({"model": "gpt-4", "messages": USER}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT)
def test_bad_chat_requests_get_their_status_and_the_openai_shape(body, status, param):
    engine = FakeEngineClient()
    err = assert_error(post(engine, "/v1/chat/completions", body), status, param)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert engine.calls == []


def test_prompt_too_long_names_the_context_length():
    engine = FakeEngineClient(max_model_len=16)
    err = assert_error(post(engine, "/v1/chat/completions", {"messages": USER}), 400, "messages")
    assert "maximum context length is 16 tokens" in err["message"]


def test_unknown_model_message():
    err = assert_error(
        post(FakeEngineClient(), "/v1/chat/completions", {"model": "gpt-4", "messages": USER}), 404
    )
    assert "gpt-4" in err["message"]


def test_a_template_that_raises_is_a_400():
    engine = FakeEngineClient(chat_template="{{ raise_exception('roles must alternate') }}")
    err = assert_error(post(engine, "/v1/chat/completions", {"messages": USER}), 400, "messages")
    assert "roles must alternate" in err["message"]


def test_engine_error_delta_is_503_or_an_error_frame():
    body = {"messages": USER}
    assert_error(
        post(FakeEngineClient(error="engine died"), "/v1/chat/completions", body),
        503,
        type_="service_unavailable",
    )
    events = sse_events(
        post(
            FakeEngineClient(error="engine died"), "/v1/chat/completions", {**body, "stream": True}
        )
    )
    assert events[-1] == "[DONE]"
    assert (
        events[-2]["error"]["type"] == "service_unavailable" and events[-2]["error"]["code"] == 503
    )
    assert "engine died" in events[-2]["error"]["message"]


def test_an_engine_refusal_keeps_its_status():
    engine = FakeEngineClient(raises=InvalidRequestError("request needs too much KV cache"))
    assert_error(post(engine, "/v1/chat/completions", {"messages": USER}), 400)
    engine = FakeEngineClient(raises=InvalidRequestError("request needs too much KV cache"))
    events = sse_events(post(engine, "/v1/chat/completions", {"messages": USER, "stream": True}))
    assert events[-2]["error"]["code"] == 400 and events[-1] == "[DONE]"


def test_a_generate_that_raises_before_iterating_fails_every_choice_count():
    class Refusing(FakeEngineClient):
        def generate(self, prompt_token_ids, params, request_id):  # not a generator
            raise InvalidRequestError("no room", param="max_tokens")

    for n in (1, 3):
        r = post(Refusing(), "/v1/chat/completions", {"messages": USER, "n": n})
        assert_error(r, 400, "max_tokens")


def test_an_unexpected_exception_is_a_500_in_the_same_shape_without_internals():
    engine = FakeEngineClient(raises=RuntimeError("secret internal detail"))
    err = assert_error(
        post(engine, "/v1/chat/completions", {"messages": USER}), 500, type_="internal_server_error"
    )
    assert "secret" not in err["message"]
    engine = FakeEngineClient(raises=RuntimeError("secret internal detail"))
    events = sse_events(post(engine, "/v1/chat/completions", {"messages": USER, "stream": True}))
    assert events[-2]["error"]["code"] == 500 and "secret" not in events[-2]["error"]["message"]


def test_unknown_route_is_openai_shaped():
    assert_error(post(FakeEngineClient(), "/v1/nothing", {}), 404, type_="not_found_error")


# ----------------------------------------------------------------------- disconnects


async def _stream_then_disconnect(
    engine: FakeEngineClient, path: str, body: dict, after: int
) -> list[bytes]:
    """Drive the app as an ASGI server would: read ``after`` body frames, then report the
    client gone."""
    app = make_app(engine)
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "client": ("test", 1), "server": ("test", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
    }  # fmt: skip
    frames: list[bytes] = []
    enough = asyncio.Event()
    requested = False

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await enough.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            frames.append(message["body"])
            if len(frames) >= after:
                enough.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    await asyncio.sleep(0.05)  # let cancelled pumps finish their cleanup
    return frames


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_disconnect_mid_stream_aborts_every_engine_request(n, path):
    engine = FakeEngineClient(endless=True)
    body = {"messages": USER} if "chat" in path else {"prompt": "Hello"}
    frames = asyncio.run(
        _stream_then_disconnect(engine, path, {**body, "stream": True, "n": n}, after=4)
    )
    assert len(frames) >= 4 and b"[DONE]" not in b"".join(frames)
    rids = [rid for _, _, rid in engine.calls]
    assert len(rids) == n
    assert sorted(engine.aborted) == sorted(rids)
    sent = engine.frames_sent
    asyncio.run(asyncio.sleep(0.05))
    assert engine.frames_sent == sent  # nothing is generating any more


@pytest.mark.parametrize("n", [1, 2])
def test_closing_stream_deltas_early_aborts_the_unfinished(n):
    engine = FakeEngineClient(endless=True)
    jobs = [EngineJob([1, 2, 3], SamplingParams(max_tokens=100), f"r-{i}") for i in range(n)]

    async def go() -> None:
        deltas = stream_deltas(engine, jobs)
        await anext(deltas)
        await deltas.aclose()

    asyncio.run(go())
    assert sorted(engine.aborted) == [f"r-{i}" for i in range(n)]


def test_finished_requests_are_not_aborted():
    engine = FakeEngineClient()
    post(engine, "/v1/chat/completions", {"messages": USER, "n": 2, "stream": True})
    post(engine, "/v1/chat/completions", {"messages": USER, "n": 2})
    assert len(engine.calls) == 4 and engine.aborted == []


# ----------------------------------------------------------------------- completions


def test_completion_non_streaming_and_streaming_agree():
    engine = FakeEngineClient()
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 50}
    full = post(engine, "/v1/completions", body).json()
    assert full["id"].startswith("cmpl-") and full["object"] == "text_completion"
    [choice] = full["choices"]
    assert (
        choice["text"] == engine.reply
        and choice["finish_reason"] == "stop"
        and choice["logprobs"] is None
    )
    assert engine.calls[0][0] == engine.tokenizer.encode("Hello world")
    events = sse_events(
        post(
            FakeEngineClient(),
            "/v1/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == full["usage"]


def test_completion_batch_choice_order_is_prompt_major():
    engine = FakeEngineClient()
    prompts = ["Hello", "The quick brown fox", "def add"]
    full = post(engine, "/v1/completions", {"prompt": prompts, "n": 2, "seed": 1}).json()
    assert [c["index"] for c in full["choices"]] == list(range(6))
    by_rid = {rid: (ids, p.seed) for ids, p, rid in engine.calls}
    for i in range(6):
        ids, seed = by_rid[f"{full['id']}-{i}"]
        assert ids == engine.tokenizer.encode(prompts[i // 2]) and seed == 1 + i % 2
        assert full["choices"][i]["text"] == f"{engine.reply} {seed}"
    assert full["usage"]["prompt_tokens"] == sum(len(engine.tokenizer.encode(p)) for p in prompts)


def test_completion_token_id_prompts():
    engine = FakeEngineClient()
    ids = engine.tokenizer.encode("Hello world")
    full = post(engine, "/v1/completions", {"prompt": [ids, ids[:1]], "echo": True}).json()
    assert [c[0] for c in engine.calls] == [ids, ids[:1]]
    assert full["choices"][0]["text"] == "Hello world" + engine.reply
    assert_error(post(engine, "/v1/completions", {"prompt": [10**6]}), 400, "prompt")


def test_echo_with_logprobs_as_lm_eval_reads_it():
    engine = FakeEngineClient()
    prompt = "The quick brown fox jumps"
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    full = post(engine, "/v1/completions", body).json()
    prompt_ids = engine.tokenizer.encode(prompt)
    gen_id = engine.reply_ids(SamplingParams())[0]
    [choice] = full["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(prompt_ids) + 1
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in [*prompt_ids, gen_id]]
    assert choice["text"] == prompt + engine.tokenizer.decode([gen_id])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-1.0] * (len(prompt_ids) - 1) + [-0.5]
    assert all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    # lm-eval: sum(token_logprobs[ctxlen:-1]); greedy iff each equals max(top.values())
    assert lp["top_logprobs"][-1] == {engine.tokenizer.decode([gen_id]): -0.5}
    assert lp["text_offset"][0] == 0
    assert all(
        b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"])
    )
    assert engine.calls[0][1].prompt_logprobs == 1 and engine.calls[0][1].logprobs == 1
    assert (
        full["usage"]["prompt_tokens"] == len(prompt_ids)
        and full["usage"]["completion_tokens"] == 1
    )


def test_echo_with_max_tokens_zero_returns_only_the_prompt():
    engine = FakeEngineClient()
    prompt = "The quick brown fox jumps"
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    full = post(engine, "/v1/completions", body).json()
    prompt_ids = engine.tokenizer.encode(prompt)
    [choice] = full["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert full["usage"]["completion_tokens"] == 0
    assert engine.calls[0][1].max_tokens == 1  # generated, then dropped

    events = sse_events(post(FakeEngineClient(), "/v1/completions", {**body, "stream": True}))
    streamed = [ch for e in events[:-1] for ch in e["choices"]]
    assert "".join(ch["text"] for ch in streamed) == prompt
    assert [t for ch in streamed if ch["logprobs"] for t in ch["logprobs"]["tokens"]] == choice[
        "logprobs"
    ]["tokens"]


def test_completion_streaming_echo_logprobs_agree_with_non_streaming():
    body = {"prompt": "Hello world", "max_tokens": 3, "echo": True, "logprobs": 2}
    full = post(FakeEngineClient(), "/v1/completions", body).json()["choices"][0]
    events = sse_events(post(FakeEngineClient(), "/v1/completions", {**body, "stream": True}))
    streamed = [ch for e in events[:-1] for ch in e["choices"]]
    assert "".join(ch["text"] for ch in streamed) == full["text"]
    merged = {k: [x for ch in streamed for x in ch["logprobs"][k]] for k in full["logprobs"]}
    assert merged == full["logprobs"]


BAD_COMPLETIONS = [
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "echo": "banana"}, "echo"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x " * 200}, "prompt"),
    ({"prompt": ["ok", "x " * 200]}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(body, param):
    engine = FakeEngineClient()
    assert_error(post(engine, "/v1/completions", body), 400, param, "invalid_request_error")
    assert engine.calls == []


def test_completion_unknown_model_is_404():
    assert_error(
        post(FakeEngineClient(), "/v1/completions", {"model": "x", "prompt": "hi"}), 404, "model"
    )


# ------------------------------------------------------------------------ OpenAI SDK


def test_the_openai_sdk_reads_our_responses():
    engine = FakeEngineClient()

    async def go() -> None:
        transport = httpx.ASGITransport(make_app(engine))
        http = httpx.AsyncClient(transport=transport, base_url="http://test/v1")
        client = openai.AsyncOpenAI(
            api_key="x", base_url="http://test/v1", http_client=http, max_retries=0
        )
        r = await client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=20, n=2, seed=3
        )
        assert [c.message.content for c in r.choices] == [f"{engine.reply} 3", f"{engine.reply} 4"]
        assert r.usage.completion_tokens > 0
        stream = await client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
        )
        parts = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == engine.reply
        assert parts[-1].usage.prompt_tokens > 0
        c = await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=5, echo=True, logprobs=1
        )
        assert (
            c.choices[0].text.startswith("Hello")
            and c.choices[0].logprobs.token_logprobs[0] is None
        )
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=USER)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=[])
        assert info.value.param == "messages"
        await http.aclose()

    asyncio.run(go())
