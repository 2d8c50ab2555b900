"""Request models (validation, defaults, to_sampling_params) and response encoding."""

from __future__ import annotations

import json

import msgspec
import pytest
from pydantic import ValidationError

from atom_core.entrypoints.http.openai.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizerInfo,
)
from atom_core.entrypoints.http.sse import data_frame, done_frame, encode_json, event_frame
from atom_core.errors import InvalidRequestError

USER = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **kw})


# ------------------------------------------------------------------------------ chat


def test_chat_defaults_follow_the_guide():
    r = chat()
    assert (r.model, r.temperature, r.top_p, r.max_tokens) == (None, 1.0, 1.0, DEFAULT_MAX_TOKENS)
    assert (r.stop, r.ignore_eos, r.stream, r.seed, r.n) == (None, False, False, None, 1)
    p = r.to_sampling_params(default_max_tokens=1000)
    assert p.max_tokens == 256 and p.temperature == 1.0 and p.logprobs is None


def test_chat_prompt_is_an_alias_of_messages():
    r = ChatCompletionRequest.model_validate({"prompt": USER})
    assert r.messages[0].content == "hi"
    both = ChatCompletionRequest.model_validate(
        {"messages": USER, "prompt": [{"role": "user", "content": "x"}]}
    )
    assert both.messages[0].content == "hi"


def test_content_parts_are_flattened_to_text():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = chat(messages=[{"role": "user", "content": parts}])
    assert r.messages[0].content == "a\nb"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": ["bare string part"]}],
        [{"role": "user", "content": 5}],
        "hi",
    ],
)
def test_bad_messages_are_refused(messages):
    with pytest.raises(ValidationError):
        chat(messages=messages)


def test_missing_messages_is_refused():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m"})


def test_unknown_fields_are_tolerated_and_null_means_default():
    r = chat(
        service_tier="auto",
        response_format={"type": "text"},
        temperature=None,
        n=None,
        stop=None,
        parallel_tool_calls=None,
    )
    assert r.temperature == 1.0 and r.n == 1 and r.stop is None and r.parallel_tool_calls is True
    assert r.model_extra["service_tier"] == "auto"


def test_explicit_null_max_tokens_means_the_rest_of_the_context():
    assert chat(max_tokens=None).to_sampling_params(default_max_tokens=777).max_tokens == 777


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params(100).max_tokens == 9


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_below_one_names_the_field(field):
    with pytest.raises(ValidationError) as info:
        chat(**{field: 0})
    assert info.value.errors()[0]["loc"][0] == field


def test_chat_sampling_fields_map_to_sampling_params():
    r = chat(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, stop="END", seed=7, ignore_eos=True,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        stop_token_ids=[3], include_stop_str_in_output=True, logprobs=True, top_logprobs=4,
    )  # fmt: skip
    p = r.to_sampling_params(100)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 40, 0.1, 7)
    assert p.stop_strings == ["END"] and p.stop_token_ids == [3] and p.include_stop_str_in_output
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.ignore_eos and p.logprobs == 4 and p.prompt_logprobs is None
    assert chat(logprobs=True).to_sampling_params(100).logprobs == 0


def test_top_logprobs_needs_logprobs():
    with pytest.raises(InvalidRequestError) as info:
        chat(top_logprobs=3).to_sampling_params(100)
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": "hot"},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"n": 0},
        {"n": 100000},
        {"top_logprobs": 21},
        {"top_k": 2**40},
        {"seed": 2**70},
        {"stop": 5},
        {"stop": ["a", 1]},
        {"stream": "maybe"},
        {"max_tokens": 1.5},
        {"chat_template_kwargs": "x"},
        # SamplingParams' ranges, stated in the model so that the document shows them
        {"temperature": -1},
        {"top_p": 0},
        {"min_p": 1.5},
        {"presence_penalty": 3},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"stop": [""]},
        {"stop": ""},
        {"stop_token_ids": [-1]},
        {"tool_choice": "sometimes"},
        {"thinking": {"type": "maybe"}},
    ],
)
def test_bad_values_are_refused_at_validation(kw):
    with pytest.raises(ValidationError):
        chat(**kw)


def test_tools_and_tool_choice_are_stored():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = chat(tools=tools, tool_choice="auto", chat_template_kwargs={"enable_thinking": False})
    assert r.tools == tools and r.tool_choice == "auto"
    assert r.chat_template_kwargs == {"enable_thinking": False}
    assert (
        chat(tool_choice={"type": "function", "function": {"name": "f"}}).tool_choice["type"]
        == "function"
    )


def test_include_usage():
    assert not chat().include_usage
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


# ----------------------------------------------------------------------- completions


@pytest.mark.parametrize(
    ("prompt", "normalised"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, normalised):
    assert completion(prompt=prompt).prompt == normalised


@pytest.mark.parametrize(
    "prompt", [[], [[]], [1, "a"], [[1], ["a"]], [True, False], 5, {"a": 1}, [1.5]]
)
def test_bad_completion_prompts_are_refused(prompt):
    with pytest.raises(ValidationError):
        completion(prompt=prompt)


def test_completion_logprobs_and_echo():
    p = completion(logprobs=3).to_sampling_params(100)
    assert p.logprobs == 3 and p.prompt_logprobs is None
    p = completion(logprobs=3, echo=True, max_tokens=1).to_sampling_params(100)
    assert p.logprobs == 3 and p.prompt_logprobs == 3 and p.max_tokens == 1
    with pytest.raises(ValidationError):
        completion(logprobs=21)


def test_echo_with_max_tokens_zero_generates_one_token_to_drop():
    r = completion(echo=True, max_tokens=0, logprobs=1)
    assert r.echo_only
    assert r.to_sampling_params(100).max_tokens == 1


def test_max_tokens_zero_without_echo_is_refused():
    with pytest.raises(InvalidRequestError) as info:
        completion(max_tokens=0).to_sampling_params(100)
    assert info.value.param == "max_tokens"


# --------------------------------------------------------------------------- encoding


def test_objects_are_tagged_and_chunks_omit_absent_fields():
    chunk = ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="x"))],
    )
    body = json.loads(encode_json(chunk))
    assert body["object"] == "chat.completion.chunk" and "usage" not in body
    assert body["choices"][0] == {
        "index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None,
        "stop_reason": None,
    }  # fmt: skip
    tokenizer = TokenizerInfo(vocab_size=320, special_ids=[0], chat_template=True)
    card = ModelCard(id="m", created=0, root="m", max_model_len=8, tokenizer=tokenizer)
    models = json.loads(encode_json(ModelList(data=[card])))
    assert models == {
        "object": "list",
        "data": [
            {"object": "model", "id": "m", "created": 0, "owned_by": "atom", "root": "m",
             "max_model_len": 8,
             "tokenizer": {"vocab_size": 320, "special_ids": [0], "chat_template": True}}
        ],
    }


def test_sse_frames():
    err = ErrorResponse(error=ErrorInfo(message="m", type="t"))
    assert data_frame({"a": 1}) == b'data: {"a":1}\n\n'
    assert done_frame() == b"data: [DONE]\n\n"
    assert event_frame("ping", {}) == b"event: ping\ndata: {}\n\n"
    assert msgspec.json.decode(data_frame(err)[6:]) == {
        "error": {"message": "m", "type": "t", "param": None, "code": None}
    }
    assert encode_json(float("nan")) == b"null"


# ------------------------------------------------------- what OpenAI and Anthropic refuse

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def error_loc(exc: ValidationError) -> tuple:
    return exc.errors()[0]["loc"]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "system", "content": None},
        {"role": "tool", "tool_call_id": "c1"},
        {"role": "assistant"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": []},
    ],
)
def test_content_is_required_but_on_an_assistant_turn_that_calls_tools(message):
    with pytest.raises(ValidationError) as info:
        chat(messages=[message])
    assert error_loc(info.value) == ("messages", 0, "content")


def test_an_assistant_turn_that_calls_tools_needs_no_content():
    r = chat(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}])
    assert r.messages[1].model_dump(exclude_none=True)["tool_calls"] == [CALL]


@pytest.mark.parametrize(
    ("call", "loc"),
    [
        ({"id": "c1", "type": "function"}, ("function",)),
        ({**CALL, "function": {"arguments": "{}"}}, ("function", "name")),
        ({**CALL, "function": {"name": "f", "arguments": {"a": 1}}}, ("function", "arguments")),
        ({**CALL, "function": {"name": "f"}}, ("function", "arguments")),
        ({"type": "function", "function": CALL["function"]}, ("id",)),
        ({"id": "c1", "function": CALL["function"]}, ("type",)),
    ],
)
def test_past_tool_calls_have_openais_shape(call, loc):
    with pytest.raises(ValidationError) as info:
        chat(messages=[*USER, {"role": "assistant", "tool_calls": [call]}])
    assert error_loc(info.value) == ("messages", 1, "tool_calls", 0, *loc)


@pytest.mark.parametrize(
    ("tool", "loc"),
    [
        ({"type": "function", "function": {"name": "f", "parameters": "x"}},
         ("function", "parameters")),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}},
         ("function", "parameters")),
        ({"type": "function", "function": {"parameters": {}}}, ("function", "name")),
        ({"type": "function"}, ("function",)),
        ({"function": {"name": "f"}}, ("type",)),
    ],
)  # fmt: skip
def test_tools_are_openai_function_tools_with_json_schema_parameters(tool, loc):
    with pytest.raises(ValidationError) as info:
        chat(tools=[tool])
    assert error_loc(info.value) == ("tools", 0, *loc)


def test_a_tool_stays_the_clients_dict():
    tool = {"type": "function", "function": {"name": "f", "x-extra": 1}, "cache": True}
    assert chat(tools=[tool]).tools == [tool]


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 2**63},
        {"max_completion_tokens": 2**64},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
        {"stop_token_ids": [2**63]},
    ],
)
def test_integers_past_int64_are_refused(kw):
    with pytest.raises(ValidationError):
        chat(**kw)


def test_int64_edges_reach_sampling_params():
    p = chat(max_tokens=2**63 - 1, seed=-(2**63), stop_token_ids=[2**63 - 1]).to_sampling_params(1)
    assert (p.max_tokens, p.seed, p.stop_token_ids) == (2**63 - 1, -(2**63), [2**63 - 1])


def test_lone_surrogates_are_refused_where_they_are():
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": "ok"}, {"role": "user", "content": "a\ud800"}])
    assert error_loc(info.value) == ("messages", 1, "content")
    with pytest.raises(ValidationError) as info:
        completion(prompt=["ok", "\udc00"])
    assert error_loc(info.value) == ("prompt", 1)


def test_min_tokens_is_refused_unless_zero():
    assert chat(min_tokens=0).to_sampling_params(10).max_tokens
    with pytest.raises(InvalidRequestError) as info:
        chat(min_tokens=3).to_sampling_params(10)
    assert info.value.param == "min_tokens"


def test_thinking_switch_spellings():
    assert chat(thinking={"type": "enabled", "budget_tokens": 9}).thinking_requested is True
    assert chat(thinking={"type": "disabled"}).thinking_requested is False
    assert chat(thinking=False, enable_thinking=True).thinking_requested is False
    assert chat(enable_thinking=True).thinking_requested is True


def test_integral_floats_are_token_ids_as_pydantic_takes_them_elsewhere():
    assert completion(prompt=[104.0, 105]).prompt == [[104, 105]]
    with pytest.raises(ValidationError):
        completion(prompt=[104.5])
