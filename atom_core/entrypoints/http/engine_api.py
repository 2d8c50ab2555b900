"""What the HTTP handlers need from the engine: the contract the real EngineClient and
test doubles both meet."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from atom_core.engine.request_stream import RequestDelta
from atom_core.sampling_params import SamplingParams


class EngineClientAPI(Protocol):
    model_name: str  # the served model name (--served-model-name, else the model path)
    max_model_len: int
    vocab_size: int  # the model's vocabulary: every prompt id must be below it
    tokenizer: Any  # a transformers tokenizer (encode/decode)
    chat_template: str | None

    @property
    def is_healthy(self) -> bool: ...

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestDelta]:
        """Deltas of one request, which has passed ``check_request`` (nothing checks it
        again), until one has ``finished``. Stop strings, detokenization and logprobs are
        applied. Closing the iterator early aborts the request in the engine (its KV blocks
        are freed within one step)."""
        ...

    async def abort(self, request_id: str) -> None: ...
