"""vLLM's ``continue_final_message`` and ``add_generation_prompt`` on /v1/chat/completions
and /tokenize: the prompt sent is the one transformers' ``apply_chat_template`` renders
with the same flags and template, whether the template is rendered by transformers, by
the Jinja encoder or by a model-side Python encoder; both delivery modes send it; and
the combinations vLLM refuses are 400s."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from atom_core.entrypoints.http.openai.chat import chat_encoder_for
from atom_core.errors import InvalidRequestError
from atom_core.parsing.chat_encoders import JinjaChatEncoder, PythonChatEncoder
from tests.entrypoints.http.asgi_app import make_app, post, sse_events
from tests.entrypoints.http.fake_engine import (
    MODEL,
    FakeEngineClient,
    assert_error,
    chat_stream_text,
)
from tests.parsing.shared_templates import template_path

CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def conversation(prefill: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world!"},
        {"role": "assistant", "content": prefill},
    ]


def transformers_prompt(engine: FakeEngineClient, messages: list[dict[str, Any]],
                        **flags: bool) -> str:
    return engine.tokenizer.apply_chat_template(
        messages, chat_template=engine.chat_template, tokenize=False, **flags)


def sent_and_counted(app: Any, engine: FakeEngineClient,
                     body: dict[str, Any]) -> tuple[list[int], int, list[int]]:
    """The ids the chat route sent the engine, its usage.prompt_tokens, and /tokenize's ids
    for the same body."""
    chat = post(app, "/v1/chat/completions", {**body, "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    tok = post(app, "/tokenize", body).json()
    assert tok["count"] == len(tok["tokens"])
    return engine.calls[-1][0], chat.json()["usage"]["prompt_tokens"], tok["tokens"]


@pytest.mark.parametrize("template", [None, "qwen3", "glm4_5", "gpt_oss"])
@pytest.mark.parametrize("prefill", ["The answer is", "Sure, ", ""])
def test_the_prompt_ends_inside_the_final_message_as_transformers_ends_it(template, prefill):
    """Through transformers' own apply_chat_template: the tiny ChatML template, and vendor
    templates that add a think block, trim the content's trailing space (GLM) or write the
    turn's end with another marker (gpt-oss)."""
    source = template_path(template).read_text() if template else None
    engine = FakeEngineClient(max_model_len=4096, chat_template=source)
    messages = conversation(prefill)
    expected = transformers_prompt(engine, messages, **CONTINUE)
    assert expected.endswith((prefill, prefill.rstrip()))  # as sent, or trimmed (GLM)
    assert not expected.endswith(("<|im_end|>\n", "<|end|>", "<|im_start|>assistant\n\n"))
    ids = engine.tokenizer.encode(expected, add_special_tokens=False)
    sent, usage, counted = sent_and_counted(make_app(engine), engine,
                                            {"messages": messages, **CONTINUE})
    assert sent == counted == ids and usage == len(ids)


def test_the_tiny_template_stops_where_the_message_does():
    """The literal prompt: no <|im_end|>, no new assistant turn."""
    engine = FakeEngineClient()
    post(engine, "/v1/chat/completions", {"messages": conversation("The answer is"), **CONTINUE})
    prompt = engine.tokenizer.decode(engine.calls[-1][0])
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world!"
                      "<|im_end|>\n<|im_start|>assistant\nThe answer is")


def test_add_generation_prompt_false_passes_through():
    engine = FakeEngineClient()
    messages = conversation("Hi.")
    expected = transformers_prompt(engine, messages, add_generation_prompt=False)
    assert expected.endswith("Hi.<|im_end|>\n")
    ids = engine.tokenizer.encode(expected, add_special_tokens=False)
    sent, usage, counted = sent_and_counted(make_app(engine), engine,
                                            {"messages": messages, "add_generation_prompt": False})
    assert sent == counted == ids and usage == len(ids)
    # The default opens the assistant's turn.
    default, _, _ = sent_and_counted(make_app(engine), engine, {"messages": messages})
    with_prompt = transformers_prompt(engine, messages, add_generation_prompt=True)
    assert default == engine.tokenizer.encode(with_prompt, add_special_tokens=False)


def test_streaming_and_not_send_the_same_prompt_and_agree():
    body = {"model": MODEL, "messages": conversation("The answer is"), **CONTINUE,
            "max_tokens": 50, "stream_options": {"include_usage": True}}
    full_engine, stream_engine = FakeEngineClient(), FakeEngineClient()
    full = post(full_engine, "/v1/chat/completions", body).json()
    events = sse_events(post(stream_engine, "/v1/chat/completions", {**body, "stream": True}))
    assert events[-1] == "[DONE]"
    assert full_engine.calls[0][0] == stream_engine.calls[0][0]
    assert chat_stream_text(events) == {0: full["choices"][0]["message"]["content"]}
    assert events[-2]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] == len(
        full_engine.calls[0][0])


# ------------------------------------------------------------------- refusals


BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True"


@pytest.mark.parametrize(
    ("extra", "final_role", "says"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "assistant", BOTH),
        ({"continue_final_message": True}, "assistant", BOTH),  # add_generation_prompt's default
        (CONTINUE, "user", "it is 'user'"),
    ],
)
@pytest.mark.parametrize("route", ["chat", "chat-stream", "tokenize"])
def test_what_vllm_refuses_is_a_400_naming_the_fields(extra, final_role, says, route):
    engine = FakeEngineClient()
    messages = conversation("Sure")
    messages[-1]["role"] = final_role
    body = {"model": MODEL, "messages": messages, **extra}
    path = "/tokenize" if route == "tokenize" else "/v1/chat/completions"
    if route == "chat-stream":
        body["stream"] = True
    error = assert_error(post(engine, path, body), 400, "continue_final_message",
                         "invalid_request_error")
    assert says in error["message"]
    assert engine.calls == []


def test_a_template_that_does_not_write_the_final_content_is_a_400():
    """transformers cannot find where to cut: the client learns why, nothing runs."""
    template = (
        "{% for m in messages %}{{ m['role'] }}:"
        "{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    )
    engine = FakeEngineClient(chat_template=template)
    for path in ("/v1/chat/completions", "/tokenize"):
        error = assert_error(post(engine, path, {"messages": conversation("Sure"), **CONTINUE}),
                             400, "messages")
        assert "continue_final_message" in error["message"]
    assert engine.calls == []


# ------------------------------------------------- encoders that render themselves

CHATML_ENCODER = textwrap.dedent(
    '''
    def encode_messages(messages, add_generation_prompt=True):
        out = "".join("<|im_start|>" + m["role"] + "\\n" + m["content"] + "<|im_end|>\\n"
                      for m in messages)
        return out + ("<|im_start|>assistant\\n" if add_generation_prompt else "")
    '''
)
# Writes an assistant turn's role but not its content: there is nowhere to cut.
DROPPING_ENCODER = textwrap.dedent(
    '''
    def encode_messages(messages, add_generation_prompt=True):
        return "".join(m["role"] + ":" + ("" if m["role"] == "assistant" else m["content"])
                       + "\\n" for m in messages)
    '''
)


def python_encoder(tmp_path: Path, source: str) -> PythonChatEncoder:
    path = tmp_path / "encoding" / "encoding_test.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return PythonChatEncoder(path)


@pytest.mark.parametrize("prefill", ["The answer is", "Sure, ", ""])
def test_a_python_encoder_is_cut_where_transformers_cuts_the_same_template(tmp_path, prefill):
    """The encoder writes what the tiny tokenizer's ChatML template writes; the handler
    renders with it (transformers cannot), and ends where transformers ends the template."""
    engine = FakeEngineClient()
    app = make_app(engine, encoder=python_encoder(tmp_path, CHATML_ENCODER))
    messages = conversation(prefill)
    for flags in (CONTINUE, {"add_generation_prompt": False}, {"add_generation_prompt": True}):
        expected = transformers_prompt(engine, messages, **flags)
        ids = engine.tokenizer.encode(expected, add_special_tokens=False)
        sent, usage, counted = sent_and_counted(app, engine, {"messages": messages, **flags})
        assert sent == counted == ids and usage == len(ids), flags


def test_a_python_encoder_that_drops_the_final_content_is_a_400(tmp_path):
    engine = FakeEngineClient()
    app = make_app(engine, encoder=python_encoder(tmp_path, DROPPING_ENCODER))
    for path in ("/v1/chat/completions", "/tokenize"):
        error = assert_error(post(app, path, {"messages": conversation("Sure"), **CONTINUE}),
                             400, "messages", "invalid_request_error")
        assert "continue_final_message" in error["message"]
    assert engine.calls == []


@pytest.mark.parametrize(
    "template", ["qwen3", "smollm2", "glm4_5", "kimi_k2", "deepseek_r1", "minimax_m2", "gpt_oss"]
)
def test_the_jinja_encoder_continues_as_transformers_does(template):
    """The Jinja encoder (start-up probes, tools) on vendor templates, against transformers."""
    engine = FakeEngineClient(chat_template=template_path(template).read_text())
    encoder = chat_encoder_for(engine)
    assert isinstance(encoder, JinjaChatEncoder)
    for prefill in ("The answer is", "Sure, ", ""):
        messages = conversation(prefill)
        assert encoder.render(messages, **CONTINUE) == transformers_prompt(
            engine, messages, **CONTINUE), prefill
    with pytest.raises(ValueError, match="cannot both be true"):
        encoder.render(messages, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="text content"):
        encoder.render([{"role": "assistant"}], **CONTINUE)
