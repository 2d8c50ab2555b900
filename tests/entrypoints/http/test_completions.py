"""/v1/completions on a scripted engine: streaming vs not, batches, token-id prompts, echo
and logprobs as lm-eval reads them, errors."""

from __future__ import annotations

import pytest

from atom_core.sampling_params import SamplingParams
from tests.entrypoints.http.asgi_app import post, sse_events
from tests.entrypoints.http.fake_engine import (
    MODEL,
    FakeEngineClient,
    assert_error,
)

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
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": " the end"}, "suffix"),
    ({"prompt": "hi", "logit_bias": {"7": 5}}, "logit_bias"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(body, param):
    engine = FakeEngineClient()
    assert_error(post(engine, "/v1/completions", body), 400, param, "invalid_request_error")
    assert engine.calls == []


def test_best_of_equal_to_n_and_an_empty_suffix_are_accepted():
    engine = FakeEngineClient()
    body = {"prompt": "hi", "n": 2, "best_of": 2, "suffix": ""}
    assert post(engine, "/v1/completions", body).status_code == 200
    assert len(engine.calls) == 2


def test_completion_unknown_model_is_404():
    assert_error(
        post(FakeEngineClient(), "/v1/completions", {"model": "x", "prompt": "hi"}),
        404,
        "model",
        code="model_not_found",
    )
