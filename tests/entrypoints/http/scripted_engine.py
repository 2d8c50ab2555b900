"""A fake EngineClientAPI that replies with a given text in chunks of ``chunk`` characters
(asgi_app.py serves it; fake_engine.py is the token-level sibling).

Stop strings are applied the way EngineClient applies them (cut before the string,
``stop_reason`` = the string), and ``max_tokens`` counts chunks, so finish reasons behave.
"""

from __future__ import annotations

import asyncio

from atom_core.engine.request_stream import RequestDelta
from atom_core.sampling_params import SamplingParams
from tests.tiny_tokenizer import tiny_tokenizer

MODEL = "scripted"


class ScriptedEngine:
    def __init__(self, reply: str, *, chunk: int = 3, chat_template: str | None = None,
                 max_model_len: int = 4096, error: str | None = None) -> None:
        self.model_name = MODEL
        self.model_aliases = {MODEL}
        self.max_model_len = max_model_len
        self.tokenizer = tiny_tokenizer()
        self.vocab_size = len(self.tokenizer)
        self.chat_template = chat_template
        self.reply, self.chunk, self.error = reply, chunk, error
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []

    @property
    def is_healthy(self) -> bool:
        return True

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        self.prompts.append(self.tokenizer.decode(prompt_token_ids))
        self.params.append(params)
        if self.error:
            yield RequestDelta(request_id, finished=True, finish_reason="abort", error=self.error)
            return
        text, stop = self.reply, None
        for s in params.stop_strings or ():
            if s in text and (stop is None or text.index(s) < text.index(stop)):
                stop = s
        if stop is not None:
            text = text[: text.index(stop)]
        pieces = [text[i : i + self.chunk] for i in range(0, len(text), self.chunk)] or [""]
        for n, piece in enumerate(pieces, 1):
            length = n >= params.max_tokens and n < len(pieces)
            last = n == len(pieces) or length
            yield RequestDelta(
                request_id, text=piece, token_ids=[0], finished=last,
                finish_reason=("length" if length else "stop") if last else None,
                stop_reason=(stop if stop is not None else 258) if last and not length else None,
                num_prompt_tokens=len(prompt_token_ids), num_output_tokens=n,
                ttft_s=0.1 if n == 1 else None, latency_s=0.2 if last else None,
            )
            if last:
                return
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        pass
