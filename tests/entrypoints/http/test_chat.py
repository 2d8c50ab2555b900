"""/v1/chat/completions on a scripted engine: responses, streaming, errors, disconnects, and
the openai SDK reading both endpoints."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from atom_core.entrypoints.http.generation import EngineJob, stream_deltas
from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import SamplingParams
from tests.entrypoints.http.asgi_app import make_app, post, sse_events
from tests.entrypoints.http.fake_engine import (
    MODEL,
    USER,
    FakeEngineClient,
    assert_error,
    chat_stream_text,
)

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
        "{% for c in m.get('tool_calls', []) %}"
        "[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
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
        lp for e in events[:-1] for ch in e["choices"] if ch["logprobs"]
        for lp in ch["logprobs"]["content"]
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
    ({"messages": USER, "stop": [""]}, 400, "stop[0]"),
    ({"messages": USER, "stop": 3}, 400, "stop"),
    ({"messages": USER, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": USER, "tool_choice": 3}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x " * 200}]}, 400, "messages"),
    ({"model": "gpt-4", "messages": USER}, 404, "model"),
    # Known fields that would constrain what is generated: refused, not ignored (output
    # constraints are served: tests/structured/test_request_fields.py).
    ({"messages": USER, "logit_bias": {"42": -100}}, 400, "logit_bias"),
    ({"messages": USER, "modalities": ["text", "audio"]}, 400, "modalities"),
    ({"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({}, "missing_required_parameter"),
        ({"messages": USER, "max_tokens": "many"}, "invalid_type"),
        ({"messages": USER, "n": 0}, "integer_below_min_value"),
        ({"messages": USER, "n": 1000}, "integer_above_max_value"),
        ({"messages": USER, "temperature": -1}, "decimal_below_min_value"),
        ({"messages": USER, "top_p": 2}, "decimal_above_max_value"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_value"),
        ({"messages": []}, "empty_array"),
        ({"messages": [{"role": "user"}]}, None),  # the server's own rule: OpenAI's has none
        ({"messages": USER, "logit_bias": {"42": -100}}, None),
        (b"not json at all", None),
    ],
)
def test_a_validation_error_carries_openais_code(body, code):
    assert_error(post(FakeEngineClient(), "/v1/chat/completions", body), 400, code=code)


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT)
def test_bad_chat_requests_get_their_status_and_the_openai_shape(body, status, param):
    engine = FakeEngineClient()
    code = "model_not_found" if status == 404 else ...
    err = assert_error(post(engine, "/v1/chat/completions", body), status, param, code=code)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert engine.calls == []


def test_the_defaults_of_refused_fields_are_accepted():
    # What asks for nothing passes: text output, an empty bias; other unknown fields too.
    engine = FakeEngineClient()
    body = {"messages": USER, "response_format": {"type": "text"}, "logit_bias": {},
            "modalities": ["text"], "some_new_field": 1}
    assert post(engine, "/v1/chat/completions", body).status_code == 200
    assert len(engine.calls) == 1


def test_prompt_too_long_names_the_context_length():
    engine = FakeEngineClient(max_model_len=16)
    err = assert_error(post(engine, "/v1/chat/completions", {"messages": USER}), 400, "messages")
    assert "maximum context length is 16 tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"  # OpenAI's code for it


def test_unknown_model_message():
    err = assert_error(
        post(FakeEngineClient(), "/v1/chat/completions", {"model": "gpt-4", "messages": USER}),
        404,
        code="model_not_found",
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
        events[-2]["error"]["type"] == "service_unavailable" and events[-2]["error"]["code"] is None
    )
    assert "engine died" in events[-2]["error"]["message"]


def test_an_engine_refusal_keeps_its_status():
    engine = FakeEngineClient(raises=InvalidRequestError("request needs too much KV cache"))
    assert_error(post(engine, "/v1/chat/completions", {"messages": USER}), 400)
    engine = FakeEngineClient(raises=InvalidRequestError("request needs too much KV cache"))
    events = sse_events(post(engine, "/v1/chat/completions", {"messages": USER, "stream": True}))
    assert events[-2]["error"]["type"] == "invalid_request_error" and events[-1] == "[DONE]"


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
    error = events[-2]["error"]
    assert error["type"] == "internal_server_error" and error["code"] is None
    assert "secret" not in error["message"]


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
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())],
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
