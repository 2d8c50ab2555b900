"""A scripted EngineClientAPI (one delta per token of a fixed reply, with logprobs, seeds,
aborts and engine errors) and the SSE/error checks of test_chat.py and
test_completions.py. scripted_engine.py is its sibling for text-level scripts
(character chunks, stop strings: the tool-call and reasoning parsers' tests)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from atom_core.engine.request_stream import RequestDelta
from atom_core.engine.sequence import Logprob
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
        self.vocab_size = len(self.tokenizer)
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


def chat_stream_text(events: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
    return texts


def assert_error(
    response: httpx.Response,
    status: int,
    param: str | None = ...,
    type_: str | None = None,
    code: str | None = ...,
):
    """OpenAI's error shape; ``code`` is OpenAI's string code or null (checked when given)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["code"] is None or isinstance(body["error"]["code"], str)
    if code is not ...:
        assert body["error"]["code"] == code
    if param is not ...:
        assert body["error"]["param"] == param
    if type_ is not None:
        assert body["error"]["type"] == type_
    return body["error"]
