"""/tokenize, /detokenize and /v1/messages/count_tokens on fake engines: each counts exactly
the prompt its generation route sends, and bad input is a 400 in the API's error shape."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI

from atom_core.entrypoints.http.guards import ApiKeyMiddleware
from atom_core.entrypoints.http.openai.chat import OpenAIServingChat
from atom_core.entrypoints.http.tokenization import ServingTokenization
from tests.entrypoints.http.asgi_app import async_client, make_app, post
from tests.entrypoints.http.fake_engine import MODEL, FakeEngineClient, assert_error
from tests.entrypoints.http.scripted_engine import ScriptedEngine
from tests.entrypoints.http.test_messages import TOOLS, sdk_http_lib
from tests.parsing.shared_templates import template_path

TEXT = "Hello world! 你好，世界 🦊 def add(a, b):\n    return a + b"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello world!"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": [{"type": "text", "text": "How are"}, {"type": "text",
                                                                     "text": "you today?"}]},
]


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient(max_model_len=512)


def test_completion_form_round_trips_and_counts_what_completions_sends(engine):
    app = make_app(engine)
    r = post(app, "/tokenize", {"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 512
    assert out["token_strs"] == engine.tokenizer.convert_ids_to_tokens(out["tokens"])
    assert post(app, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}).json() == {
        "prompt": TEXT}
    c = post(app, "/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 1}).json()
    assert c["usage"]["prompt_tokens"] == out["count"]
    assert engine.calls[-1][0] == out["tokens"]
    assert post(app, "/tokenize", {"prompt": TEXT}).json()["token_strs"] is None


def test_chat_form_counts_what_chat_completions_sends(engine):
    """The openai SDK's chat completion (its route), and /tokenize over raw HTTP (vLLM's)."""
    app = make_app(engine)

    async def go() -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with async_client(app) as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http,
                                        max_retries=0)
            chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                        max_tokens=1)
            tok = (await http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})).json()
            bare = (await http.post("/tokenize", json={"messages": MESSAGES,
                                                        "add_generation_prompt": False})).json()
            text = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
            return chat, tok, bare, text

    chat, tok, bare, text = asyncio.run(go())
    assert chat.usage.prompt_tokens == tok["count"] == len(tok["tokens"])
    assert engine.calls[-1][0] == tok["tokens"]
    assert text["prompt"].endswith("<|im_start|>assistant\n")
    assert "Be brief." in text["prompt"] and "How are\nyou today?" in text["prompt"]
    # Without the generation prompt: the same turns, minus the assistant's opening.
    assert bare["count"] < tok["count"] and tok["tokens"][: bare["count"]] == bare["tokens"]
    # The text re-tokenizes to the same ids: a round trip.
    again = post(app, "/tokenize", {"prompt": text["prompt"], "add_special_tokens": False})
    assert again.json()["tokens"] == tok["tokens"]


def test_chat_form_with_tools_and_the_thinking_switch_counts_the_real_template():
    """Qwen3's template writes tools and answers enable_thinking: the count follows both."""
    engine = ScriptedEngine("ok", chat_template=template_path("qwen3").read_text())
    app = make_app(engine)
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
             for t in TOOLS]
    counts = {}
    for thinking in (True, False):
        body = {"model": "scripted", "messages": MESSAGES[:2], "tools": tools,
                "enable_thinking": thinking}
        chat = post(app, "/v1/chat/completions", {**body, "max_tokens": 1}).json()
        tok = post(app, "/tokenize", body).json()
        assert chat["usage"]["prompt_tokens"] == tok["count"]
        prompt = post(app, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"]
        assert prompt == engine.prompts[-1] and "get_weather" in prompt
        counts[thinking] = tok["count"]
    assert counts[False] > counts[True]  # the switch wrote an empty think block


def test_a_prompt_past_the_context_is_counted_not_refused():
    engine = FakeEngineClient(max_model_len=8)
    app = make_app(engine)
    out = post(app, "/tokenize", {"prompt": TEXT}).json()
    assert out["count"] > 8 and out["max_model_len"] == 8
    chat = post(app, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["count"] > 8
    assert_error(post(app, "/v1/completions", {"prompt": TEXT}), 400, "prompt",
                 code="context_length_exceeded")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens"),
        ({"prompt": "x", "return_token_strs": [1]}, "return_token_strs"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": MESSAGES, "add_generation_prompt": "maybe"}, "add_generation_prompt"),
        ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
        ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
        (b'{"prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate
    ],
)
def test_bad_tokenize_requests_are_400(engine, body, param):
    assert_error(post(engine, "/tokenize", body), 400, param, "invalid_request_error")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "tokens"),
        ({"tokens": "abc"}, "tokens"),
        ({"tokens": [1, "a"]}, "tokens[1]"),
        ({"tokens": [1.5]}, "tokens[0]"),
        ({"tokens": [-1]}, "tokens[0]"),
        ({"tokens": [1, 2**70]}, "tokens[1]"),
        ({"tokens": [1, 320, 2]}, "tokens[1]"),  # the vocabulary is [0, 320)
        (b'{"tokens": [1], "model": "a\\ud800"}', "model"),
    ],
)
def test_bad_detokenize_requests_are_400(engine, body, param):
    assert_error(post(engine, "/detokenize", body), 400, param, "invalid_request_error")


def test_malformed_bodies_unknown_models_and_no_tokenizer():
    engine = FakeEngineClient()
    for path in ("/tokenize", "/detokenize"):
        assert_error(post(engine, path, b"{not json"), 400, None)
        assert_error(post(engine, path, b"[1, 2]"), 400)
    assert_error(post(engine, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model",
                 code="model_not_found")
    assert_error(post(engine, "/detokenize", {"model": "nope", "tokens": [1]}), 404, "model")
    assert post(engine, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    engine.tokenizer = None
    assert_error(post(engine, "/tokenize", {"prompt": "x"}), 400, None)
    assert_error(post(engine, "/detokenize", {"tokens": [1]}), 400, None)


def test_tokenizer_info_is_the_served_tokenizers():
    engine = FakeEngineClient()
    info = ServingTokenization(OpenAIServingChat(engine)).info()
    assert info.vocab_size == engine.tokenizer.vocab_size == 320
    assert info.special_ids == sorted(engine.tokenizer.all_special_ids) and info.chat_template


# ------------------------------------------------------------------ count_tokens


def anthropic_app(template: str = "qwen3") -> tuple[FastAPI, ScriptedEngine]:
    engine = ScriptedEngine("The answer.", chat_template=template_path(template).read_text())
    return make_app(engine), engine


def test_count_tokens_is_the_input_tokens_of_the_message():
    """The anthropic SDK on both routes: system, tools, past tool use and thinking."""
    app, _ = anthropic_app()
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]},
    ]
    cases = [
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": conversation, "system": "Be brief.", "tools": TOOLS},
        {"messages": conversation, "tools": TOOLS, "thinking": {"type": "disabled"}},
        {"messages": conversation, "system": [{"type": "text", "text": "A"},
                                              {"type": "text", "text": "B"}]},
    ]

    async def go() -> list[tuple[int, int]]:
        http_lib = sdk_http_lib()
        transport = http_lib.ASGITransport(app)
        async with http_lib.AsyncClient(transport=transport, base_url="http://test") as http:
            client = anthropic.AsyncAnthropic(base_url="http://test", api_key="x",
                                              http_client=http, max_retries=0)
            out = []
            for kw in cases:
                counted = await client.messages.count_tokens(model="scripted", **kw)
                message = await client.messages.create(model="scripted", max_tokens=4, **kw)
                out.append((counted.input_tokens, message.usage.input_tokens))
            return out

    pairs = asyncio.run(go())
    assert all(counted == used > 0 for counted, used in pairs), pairs
    assert len({c for c, _ in pairs}) == len(cases)  # each case is its own prompt


def test_count_tokens_errors_are_anthropic_shaped():
    app, _ = anthropic_app()
    for body, status in [
        ({"model": "scripted"}, 400),
        ({"model": "scripted", "messages": []}, 400),
        ({"model": "scripted", "messages": [{"role": "robot", "content": "x"}]}, 400),
        ({"model": "scripted", "messages": [{"role": "user", "content": "x"}],
          "tools": [{"name": "t", "input_schema": {"type": "string"}}]}, 400),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ]:
        r = post(app, "/v1/messages/count_tokens", body)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    r = post(app, "/v1/messages/count_tokens", b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_the_routes_honour_the_api_key(engine):
    app = ApiKeyMiddleware(make_app(engine), api_key="s3cret")

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            key = {"Authorization": "Bearer s3cret"}
            return [
                await http.post("/tokenize", json={"prompt": "x"}),
                await http.post("/detokenize", json={"tokens": [1]}),
                await http.post("/v1/messages/count_tokens", json={}),
                await http.post("/tokenize", json={"prompt": "x"}, headers=key),
                await http.post("/detokenize", json={"tokens": [1]}, headers=key),
            ]

    refused_t, refused_d, refused_c, ok_t, ok_d = asyncio.run(go())
    assert_error(refused_t, 401, None, "authentication_error")
    assert_error(refused_d, 401, None, "authentication_error")
    assert refused_c.status_code == 401 and refused_c.json()["type"] == "error"
    assert ok_t.status_code == ok_d.status_code == 200
